"""Newton–Schulz orthogonalisation of a batch of matrices (the core of Muon).

Pure tensor functions with no knowledge of models or optimizers, so they can be reused by a
distributed Muon (one owner rank per block), benchmarked alone, and tested against an SVD.
"""

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


def ns_compute_dtype(x: torch.Tensor, cpu_bf16_min_flops: float | None = None) -> torch.dtype:
    """The dtype the iteration runs in for the blocks `x` (`[..., rows, cols]`): bf16 on CUDA;
    on a CPU, bf16 for calls of at least `cpu_bf16_min_flops` Newton–Schulz FLOPs (the
    crossover this machine measured, `k3train/optim/bf16_probe.py`; `math.inf`: never), fp32
    below; float64 kept as is.

    bf16 is what Moonlight and torch.optim.Muon run (NS output only needs singular values in
    roughly [0.5, 1.5], which bf16 easily resolves: about 1e-2 relative to float64); a CPU runs
    it only where it measured bf16 faster; float64 input stays float64 so tests can compare
    against exact maths. The job measures the crossover once and gives every rank the same one
    (`k3train/training/build.py`); without it the probe of this process decides.
    """
    if x.dtype == torch.float64:
        return torch.float64
    if x.is_cuda:
        return torch.bfloat16
    if x.device.type == "cpu" and x.ndim >= 2:
        if cpu_bf16_min_flops is None:
            # Imported here: the probe times `newton_schulz` of this module.
            from k3train.optim.bf16_probe import cpu_bf16_min_flops as measured_crossover

            cpu_bf16_min_flops = measured_crossover()
        rows, cols = x.shape[-2:]
        blocks = x.numel() // max(rows * cols, 1)
        if blocks * ns_flops(rows, cols) >= cpu_bf16_min_flops:
            return torch.bfloat16
    return torch.float32


def resolve_ns_dtype(setting: NsDtype, x: torch.Tensor, cpu_bf16_min_flops: float | None = None) -> torch.dtype:
    """The dtype Newton–Schulz runs in for the blocks `x` under the `optimizer.newton_schulz_dtype`
    setting: "auto" picks per device and size (`ns_compute_dtype`, with the CPU crossover given);
    "float32"/"bfloat16" force it, except that float64 input stays float64 (the exact-maths
    tests and the float64 parallel checks)."""
    if setting == "auto" or x.dtype == torch.float64:
        return ns_compute_dtype(x, cpu_bf16_min_flops)
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
