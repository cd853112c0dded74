"""Newton–Schulz orthogonalisation of a batch of matrices (the core of Muon).

Pure tensor functions with no knowledge of models or optimizers, so they can be reused by a
distributed Muon (one owner rank per block), benchmarked alone, and tested against an SVD.
"""

import functools
from typing import Literal

import torch

NsDtype = Literal["auto", "float32", "bfloat16"]
"""The `optimizer.newton_schulz_dtype` setting: "auto" is `ns_compute_dtype`'s choice."""

NS_COEFFICIENTS: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
"""Quintic coefficients (a, b, c) of Keller Jordan / Moonlight; NeMo calls this set "simple"."""
NS_STEPS: int = 5
"""Iterations used by Moonlight and Kimi K2/K3."""
NS_EPS: float = 1e-7
"""Added to the Frobenius norm before dividing, so a zero gradient stays zero."""


@functools.cache
def cpu_has_bf16_matrix_units() -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (AMX tiles), where oneDNN's bf16
    matmuls outrun fp32 (docs/performance.md has the measured rates)."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe()) if probe is not None else False


CPU_BF16_MIN_FLOPS = 10**8
"""On a CPU with AMX, the Newton–Schulz FLOPs of one call (a batch of blocks) from which bf16
pays: its matmuls carry a fixed cost per call (the casts and oneDNN's set-up), which smaller
calls do not earn back (docs/performance.md has the measured crossover)."""


def ns_compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the iteration runs in for the blocks `x` (`[..., rows, cols]`): bf16 on CUDA,
    and on CPUs with bf16 matrix units (AMX) for calls of at least `CPU_BF16_MIN_FLOPS`; fp32
    otherwise; float64 kept as is.

    bf16 is what Moonlight and torch.optim.Muon run (NS output only needs singular values in
    roughly [0.5, 1.5], which bf16 easily resolves: about 1e-2 relative to float64); on a CPU
    without AMX bf16 matmuls are slower than fp32, and with AMX small calls are, so those keep
    fp32; float64 input stays float64 so tests can compare against exact maths.
    """
    if x.dtype == torch.float64:
        return torch.float64
    if x.is_cuda:
        return torch.bfloat16
    if x.device.type == "cpu" and x.ndim >= 2 and cpu_has_bf16_matrix_units():
        rows, cols = x.shape[-2:]
        blocks = x.numel() // max(rows * cols, 1)
        if blocks * ns_flops(rows, cols) >= CPU_BF16_MIN_FLOPS:
            return torch.bfloat16
    return torch.float32


def resolve_ns_dtype(setting: NsDtype, x: torch.Tensor) -> torch.dtype:
    """The dtype Newton–Schulz runs in for the blocks `x` under the `optimizer.newton_schulz_dtype`
    setting: "auto" picks per device and size (`ns_compute_dtype`); "float32"/"bfloat16" force it, except that
    float64 input stays float64 (the exact-maths tests and the float64 parallel checks)."""
    if setting == "auto" or x.dtype == torch.float64:
        return ns_compute_dtype(x)
    if setting == "float32":
        return torch.float32
    if setting == "bfloat16":
        return torch.bfloat16
    raise ValueError(f"optimizer.newton_schulz_dtype must be auto, float32 or bfloat16, got {setting!r}")


def newton_schulz(
    x: torch.Tensor,
    steps: int = NS_STEPS,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = NS_EPS,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Approximately orthogonalise each matrix of `x` (shape `[..., rows, cols]`).

    Returns `U S' V^T` for `x = U S V^T`, with `S'` roughly in [0.5, 1.5] (not exactly 1: the
    coefficients trade convergence for a steep slope at zero, see Keller Jordan's Muon notes).
    Every matrix of the batch is normalised by its own Frobenius norm, so the matrices are
    independent. The result has `x`'s shape and is in `compute_dtype` (default:
    `ns_compute_dtype(x)`); the caller casts it when it adds it to a parameter.
    """
    if x.ndim < 2:
        raise ValueError(f"newton_schulz needs matrices [..., rows, cols], got {tuple(x.shape)}")
    a, b, c = coefficients
    dtype = compute_dtype or ns_compute_dtype(x)
    # Work on the wide orientation: the Gram matrix X X^T is then [min, min], the cheap side.
    transposed = x.size(-2) > x.size(-1)
    if transposed:
        x = x.mT
    # Normalise in the input's precision (fp32 momentum) before rounding to bf16: the Frobenius
    # norm bounds the spectral norm, so every singular value starts in [0, 1].
    norm = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)
    y = (x / (norm + eps)).to(dtype)
    shape = y.shape
    y = y.reshape(-1, *shape[-2:])  # one batch dimension, for baddbmm
    for _ in range(steps):
        gram = torch.bmm(y, y.mT)
        # b·G + c·G², then a·Y + P·Y: the scalars ride in the matmuls (as torch.optim.Muon does),
        # 3 kernels per step instead of 7, and in bf16 the sums are rounded once, not thrice.
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        y = torch.baddbmm(y, poly, y, beta=a)
    y = y.view(shape)
    return y.mT if transposed else y


def ns_cost(rows: int, cols: int) -> int:
    """Relative cost of orthogonalising one `[rows, cols]` matrix: `rows * cols * min(rows, cols)`.

    Each NS step does X X^T and B X (`min^2 * max` multiply-adds each) and A A (`min^3`), so
    this is proportional to the FLOPs for a fixed step count. Megatron's
    layer-wise distributed optimizer balances owners with the same `max * min^2` rule.
    """
    return rows * cols * min(rows, cols)


def ns_flops(rows: int, cols: int, steps: int = NS_STEPS) -> int:
    """FLOPs of orthogonalising one `[rows, cols]` matrix with `steps` quintic iterations.

    With `m = min(rows, cols)`, `M = max(rows, cols)` each step multiplies `X X^T` (`2 m^2 M`),
    `A A` (`2 m^3`) and `B X` (`2 m^2 M`); the elementwise terms and the normalisation are not
    counted (as model FLOPs leave out elementwise work). These are optimizer FLOPs, reported next
    to the model FLOPs of MFU, never inside them.
    """
    small, large = min(rows, cols), max(rows, cols)
    return steps * (4 * small * small * large + 2 * small**3)
