"""Guarded dispatch of `chunk_kda` to flash-linear-attention's Triton kernel.

fla-core (`fla.ops.kda.chunk_kda`) takes the same layouts as our kernels: q, k, g `[B, T, H, K]`,
v `[B, T, H, V]`, beta `[B, T, H]`, state `[B, H, K, V]` (its default `state_v_first=False`), and
wants the initial state in fp32. Importing `fla.ops` pulls in triton, which CPU machines may lack
and which cannot launch there anyway, so the import is only ever attempted for CUDA tensors and
any failure to import falls back to the PyTorch path.

`run_fla_chunk_kda_from_raw` hands fla the raw inputs instead (`raw_inputs.chunk_kda_from_raw`):
its kernel then L2-normalises q and k, applies the decay gate and takes the sigmoid of β itself,
forward and backward, instead of five separate elementwise functions around it (fewer launches
and passes over `[B, T, H, K]` tensors). It takes the bounded gate through `lower_bound`, on the
same chunk kernels as precomputed gates. fla's `safe_gate=True` (tensor-core sub-chunks for gates
in [−5, 0), `FLA_SAFE_GATE_RANGE`; TF32 and bf16x3 products where the default path keeps fp32)
is opt-in, until `tools/gpu_check.py`'s `kda_fla_raw` rows have measured its accuracy on a GPU.
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import itertools
from collections.abc import Callable

import torch

BACKENDS = ("auto", "torch", "fla")
# fla's Triton kernels handle half and single precision and head dims up to 256.
_FLA_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FLA_MAX_HEAD_DIM = 256
# fla's `safe_gate=True` takes lower bounds in [-5, 0): its tiles are sized for them.
FLA_SAFE_GATE_RANGE = (-5.0, 0.0)
# The first fla-core release whose `chunk_kda` takes raw inputs as `run_fla_chunk_kda_from_raw`
# passes them (`A_log` and `dt_bias` travel through its `**kwargs`, which no signature shows).
FLA_RAW_INPUT_VERSION = (0, 6, 0)


@functools.cache
def load_fla_chunk_kda() -> Callable | None:
    """Return `fla.ops.kda.chunk_kda`, or None when fla-core (or triton) does not import.

    Cached because Python does not remember failed imports: without the cache every call on a
    machine without fla would search `sys.path` again.
    """
    try:
        from fla.ops.kda import chunk_kda as fla_chunk_kda
    except Exception:  # missing package, missing triton, or a broken install: use PyTorch
        return None
    return fla_chunk_kda


@functools.cache
def load_fla_causal_conv1d() -> Callable | None:
    """`fla.modules.causal_conv1d.causal_conv1d` (Triton), or None when it does not import."""
    try:
        from fla.modules.causal_conv1d import causal_conv1d
    except Exception:
        return None
    return causal_conv1d


def use_fla_short_conv(x: torch.Tensor, tail: torch.Tensor | None) -> bool:
    """Whether `short_conv_silu` runs on fla's causal convolution: a CUDA input of a dtype fla
    takes, no tail (whole sequences, as training runs them), and fla importing."""
    return x.is_cuda and x.dtype in _FLA_DTYPES and tail is None and load_fla_causal_conv1d() is not None


def run_fla_short_conv_silu(
    x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor | None = None
) -> torch.Tensor:
    """`silu(causal depthwise conv(x))` by fla's Triton kernel: `x [B, T, C]`, `weight [C, 1, W]`,
    zeros before the first token; forward and backward one launch each (fla computes in fp32 and
    returns x's dtype). `cu_seqlens`: `x` is `[1, N, C]` and every segment starts from zeros."""
    causal_conv1d = load_fla_causal_conv1d()
    if causal_conv1d is None:
        raise RuntimeError("fla.modules.causal_conv1d does not import")
    extra = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}
    output, _ = causal_conv1d(x, weight.view(weight.shape[0], weight.shape[-1]), activation="silu", **extra)
    return output


@functools.cache
def load_fla_rms_norm_gated() -> Callable | None:
    """`fla.modules.fused_norm_gate.rms_norm_gated` (Triton), or None when it does not import."""
    try:
        from fla.modules.fused_norm_gate import rms_norm_gated
    except Exception:
        return None
    return rms_norm_gated


def use_fla_gated_norm(x: torch.Tensor, gate: torch.Tensor) -> bool:
    """Whether `gated_rms_norm` runs on fla's fused kernel: CUDA inputs of one dtype fla takes (it
    returns the gate's gradient in x's dtype) and fla importing."""
    return x.is_cuda and x.dtype in _FLA_DTYPES and gate.dtype == x.dtype and load_fla_rms_norm_gated() is not None


def run_fla_gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`RMSNorm(x) · weight · sigmoid(gate)` over the last dim by fla's fused kernel (one launch
    forward, one backward; fp32 inside, x's dtype out)."""
    rms_norm_gated = load_fla_rms_norm_gated()
    if rms_norm_gated is None:
        raise RuntimeError("fla.modules.fused_norm_gate does not import")
    return rms_norm_gated(x, gate, weight, None, activation="sigmoid", eps=eps)


def use_fla_backend(backend: str, *tensors: torch.Tensor | None) -> bool:
    """Decide whether `chunk_kda` runs on fla for these tensors (None entries are skipped).

    "torch" never does; "auto" does for CUDA tensors of a dtype and head size fla supports when
    fla imports; "fla" must (ValueError for non-CUDA tensors, RuntimeError if fla is missing).
    Nothing is imported unless every tensor is on CUDA.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return False
    present = [t for t in tensors if t is not None]
    on_cuda = all(t.is_cuda for t in present)
    if backend == "fla":
        if not on_cuda:
            raise ValueError("backend='fla' needs CUDA tensors; use backend='torch' on CPU")
        if load_fla_chunk_kda() is None:
            raise RuntimeError("backend='fla' requested but fla.ops.kda does not import")
        return True
    query = present[0]
    supported = query.dtype in _FLA_DTYPES and query.shape[-1] <= _FLA_MAX_HEAD_DIM
    return on_cuda and supported and load_fla_chunk_kda() is not None


def run_fla_chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Call fla's `chunk_kda` with our layouts (q/k already normalised, g in log space);
    `cu_seqlens`: fla's varlen form (`[1, N, ...]` inputs, one state per segment)."""
    fla_chunk_kda = load_fla_chunk_kda()
    if fla_chunk_kda is None:
        raise RuntimeError("fla.ops.kda does not import")
    if initial_state is not None:
        initial_state = initial_state.float()  # fla requires an fp32 initial state
    return fla_chunk_kda(
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        **({} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}),
    )


# The keywords `run_fla_chunk_kda_from_raw` relies on. fla's `chunk_kda` takes `**kwargs`, so a
# release without one of them would ignore it silently (q and k left unnormalised, the gate not
# applied): such a release gets the unfused steps instead.
FLA_RAW_INPUT_KEYWORDS = (
    "use_qk_l2norm_in_kernel",
    "use_gate_in_kernel",
    "use_beta_sigmoid_in_kernel",
    "safe_gate",
    "lower_bound",
)


def _release(version: str) -> tuple[int, ...]:
    """`"0.6.0"` → `(0, 6, 0)`; the numeric prefix of each part (`"1rc2"` → 1)."""
    parts = []
    for part in version.split(".")[:3]:
        digits = "".join(itertools.takewhile(str.isdigit, part))
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


@functools.cache
def fla_takes_raw_inputs() -> bool:
    """Whether the installed fla's `chunk_kda` names every keyword of `FLA_RAW_INPUT_KEYWORDS`
    and fla-core is at least `FLA_RAW_INPUT_VERSION`."""
    fla_chunk_kda = load_fla_chunk_kda()
    if fla_chunk_kda is None:
        return False
    try:
        parameters = inspect.signature(fla_chunk_kda).parameters
    except (TypeError, ValueError):
        return False
    version = installed_fla_version()
    return (
        all(name in parameters for name in FLA_RAW_INPUT_KEYWORDS)
        and version is not None
        and _release(version) >= FLA_RAW_INPUT_VERSION
    )


def installed_fla_version() -> str | None:
    """fla-core's version as installed (its distribution metadata), or None."""
    try:
        return importlib.metadata.version("fla-core")
    except importlib.metadata.PackageNotFoundError:
        return None


def fla_takes_safe_gate(lower_bound: float | None) -> bool:
    """Whether fla's `safe_gate` can run this gate: bounded, within `FLA_SAFE_GATE_RANGE`."""
    low, high = FLA_SAFE_GATE_RANGE
    return lower_bound is not None and low <= lower_bound < high


def run_fla_chunk_kda_from_raw(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gate_input: torch.Tensor,
    beta_logits: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float | None,
    scale: float,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    safe_gate: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's `chunk_kda` on raw inputs (arguments as `raw_inputs.chunk_kda_from_raw`): q and k
    before their L2 normalisation, the gate's input before the gate, β's logits. `safe_gate`:
    fla's tensor-core path for bounded gates in `FLA_SAFE_GATE_RANGE` (module docstring)."""
    fla_chunk_kda = load_fla_chunk_kda()
    if fla_chunk_kda is None:
        raise RuntimeError("fla.ops.kda does not import")
    if not fla_takes_raw_inputs():
        raise RuntimeError(
            f"this fla-core's chunk_kda lacks some of {FLA_RAW_INPUT_KEYWORDS} or predates "
            f"{'.'.join(map(str, FLA_RAW_INPUT_VERSION))}: upgrade fla-core or use the unfused steps"
        )
    if safe_gate and not fla_takes_safe_gate(lower_bound):
        raise ValueError(
            f"fla's safe_gate takes lower bounds in [{FLA_SAFE_GATE_RANGE[0]}, "
            f"{FLA_SAFE_GATE_RANGE[1]}), got {lower_bound}"
        )
    if initial_state is not None:
        initial_state = initial_state.float()
    return fla_chunk_kda(
        q,
        k,
        v,
        gate_input,
        beta_logits,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True,
        safe_gate=safe_gate,
        lower_bound=lower_bound,  # the bounded gate, with or without safe_gate
        A_log=A_log,
        dt_bias=dt_bias,
    )
