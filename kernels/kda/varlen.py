"""Kimi Delta Attention over variable-length segments of one token stream (fla's `cu_seqlens`).

Inputs follow fla's varlen convention: `q, k, g` `[1, N, H, K]`, `v` `[1, N, H, V]`, `beta`
`[1, N, H]`, and `cu_seqlens` `[S + 1]` (`kernels.segments`). Every segment runs the
recurrence from its own initial state (`[S, H, K, V]`, zeros if None), as if it were a sequence
of its own, and `final_state` is `[S, H, K, V]`: the state after each segment's last token.

- `chunk_kda_varlen_reference`: one `naive_recurrent_kda` call per segment.
- `chunk_kda_varlen`: on CUDA with fla, its `chunk_kda` with `cu_seqlens` (the segments in
  place, no padding); elsewhere the segments grouped by their number of chunks
  (`kernels.segments.length_buckets`), each group packed into a zero-padded batch and run by one
  `chunk_kda` call, so a segment is padded to whole chunks as it would be alone, not to the
  longest segment. Padding follows each segment's last token with `k = v = β = 0` and `g = 0`,
  which leaves the state exactly as it was, so the final states are those of the segments.
"""

from __future__ import annotations

import torch

from ..segments import length_buckets, pack_segments, unpack_buckets
from . import fla_backend
from .chunk import chunk_kda
from .naive import naive_recurrent_kda


def _check_varlen(q: torch.Tensor, cu_seqlens: torch.Tensor, initial_state: torch.Tensor | None) -> int:
    if q.dim() != 4 or q.shape[0] != 1:
        raise ValueError(f"varlen KDA takes [1, N, H, K] inputs (segments flattened), got {tuple(q.shape)}")
    if cu_seqlens.dim() != 1 or int(cu_seqlens[-1]) != q.shape[1]:
        raise ValueError(f"cu_seqlens must be [S + 1] ending at N = {q.shape[1]}, got {cu_seqlens.tolist()}")
    segments = len(cu_seqlens) - 1
    if initial_state is not None and initial_state.shape[0] != segments:
        raise ValueError(f"initial_state has {initial_state.shape[0]} states for {segments} segments")
    return segments


def chunk_kda_varlen_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The definition: each segment through the token-by-token recurrence on its own."""
    segments = _check_varlen(q, cu_seqlens, initial_state)
    outputs, finals = [], []
    for s in range(segments):
        lo, hi = int(cu_seqlens[s]), int(cu_seqlens[s + 1])
        state = None if initial_state is None else initial_state[s : s + 1]
        o, final = naive_recurrent_kda(
            q[:, lo:hi],
            k[:, lo:hi],
            v[:, lo:hi],
            g[:, lo:hi],
            beta[:, lo:hi],
            scale=scale,
            initial_state=state,
            output_final_state=True,
        )
        outputs.append(o)
        assert final is not None  # asked for
        finals.append(final)
    final_state = torch.cat(finals) if output_final_state else None
    return torch.cat(outputs, dim=1), final_state


def chunk_kda_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`chunk_kda_varlen_reference`, chunkwise (arguments as there and as `chunk_kda`)."""
    _check_varlen(q, cu_seqlens, initial_state)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if fla_backend.use_fla_backend(backend, q, k, v, g, beta, initial_state):
        return fla_backend.run_fla_chunk_kda(
            q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens=cu_seqlens
        )
    buckets = length_buckets(cu_seqlens, chunk_size)
    outputs, finals = [], []
    for segments in buckets:
        q_b, k_b, v_b, g_b, beta_b = (pack_segments(t[0], cu_seqlens, segments=segments) for t in (q, k, v, g, beta))
        o, final = chunk_kda(
            q_b,
            k_b,
            v_b,
            g_b,
            beta_b,
            scale=scale,
            initial_state=None if initial_state is None else initial_state.index_select(0, segments),
            output_final_state=output_final_state,
            chunk_size=chunk_size,
            backend="torch" if backend == "auto" else backend,
        )
        outputs.append(o)
        finals.append(final)
    output = unpack_buckets(outputs, cu_seqlens, buckets).unsqueeze(0)
    if not output_final_state:
        return output, None
    order = torch.argsort(torch.cat(buckets))  # the final states back in segment order
    return output, torch.cat([f for f in finals if f is not None]).index_select(0, order)


__all__ = ["chunk_kda_varlen", "chunk_kda_varlen_reference"]
