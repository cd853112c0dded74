"""Guarded dispatch of `chunk_kda` to flash-linear-attention's Triton kernel.

fla-core (`fla.ops.kda.chunk_kda`) takes the same layouts as our kernels: q, k, g `[B, T, H, K]`,
v `[B, T, H, V]`, beta `[B, T, H]`, state `[B, H, K, V]` (its default `state_v_first=False`), and
wants the initial state in fp32. Importing `fla.ops` pulls in triton, which CPU machines may lack
and which cannot launch there anyway, so the import is only ever attempted for CUDA tensors and
any failure to import falls back to the PyTorch path.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

BACKENDS = ("auto", "torch", "fla")
# fla's Triton kernels handle half and single precision and head dims up to 256.
_FLA_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FLA_MAX_HEAD_DIM = 256


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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Call fla's `chunk_kda` with our layouts (q/k already normalised, g in log space)."""
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
    )
