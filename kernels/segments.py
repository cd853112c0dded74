"""Variable-length segments of a flattened token stream: offsets, and packing into a padded batch.

Packed training sequences hold several documents; a token mixer that must not look across
documents runs each one as a sequence of its own. The segments are described as fla's varlen
kernels take them: the token rows `[B, T]` flattened to `N = B·T` tokens, and `cu_seqlens`
`[S + 1]` (int64), the offsets where each of the `S` segments starts, then `N`. A segment
starts at the beginning of every row and wherever `starts` is True.

`pack_segments` gathers the segments into a zero-padded batch `[S, max_len, ...]`, so a kernel
that only knows whole sequences (the chunkwise KDA, the short convolution, causal SDPA) runs
every segment at once; `unpack_segments` scatters its output back. Both are index gathers, so
autograd carries gradients through them, and padding sits after each segment's last token,
where a causal kernel never reads it. `length_buckets` groups the segments by their length in
units (a kernel's chunk), so that each group pads only to its own longest segment
(`pack_segments(..., segments=ids)` per group, `unpack_buckets` to put them back together).
"""

from __future__ import annotations

import torch


def segment_offsets(starts: torch.Tensor) -> torch.Tensor:
    """`cu_seqlens` `[S + 1]` (int64) of the rows of `starts` (`[B, T]` bool, True where a segment
    starts) flattened to `B·T` tokens; position 0 of every row starts a segment whatever it says."""
    if starts.dim() != 2:
        raise ValueError(f"segment starts must be [batch, seq], got shape {tuple(starts.shape)}")
    flags = starts.to(torch.bool).clone()
    flags[:, 0] = True
    begins = torch.nonzero(flags.reshape(-1), as_tuple=False).reshape(-1)
    total = torch.tensor([flags.numel()], dtype=torch.int64, device=starts.device)
    return torch.cat([begins.to(torch.int64), total])


def segment_lengths(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Tokens of each segment, `[S]`."""
    return cu_seqlens[1:] - cu_seqlens[:-1]


def _packed_index(cu_seqlens: torch.Tensor, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For every slot `(s, i)` of the padded batch, its token index (`N` for padding), and for
    every token its slot `s · max_len + i`."""
    lengths = segment_lengths(cu_seqlens)
    total = int(cu_seqlens[-1])
    slot = torch.arange(max_len, device=cu_seqlens.device)
    token = cu_seqlens[:-1, None] + slot[None, :]
    token = torch.where(slot[None, :] < lengths[:, None], token, torch.full_like(token, total))
    segment_of_token = torch.repeat_interleave(torch.arange(len(lengths), device=cu_seqlens.device), lengths)
    position = torch.arange(total, device=cu_seqlens.device) - cu_seqlens[:-1][segment_of_token]
    return token.reshape(-1), segment_of_token * max_len + position


def max_segment_length(cu_seqlens: torch.Tensor) -> int:
    """The longest segment (the padded batch's length)."""
    return int(segment_lengths(cu_seqlens).max()) if len(cu_seqlens) > 1 else 0


def length_buckets(cu_seqlens: torch.Tensor, unit: int) -> list[torch.Tensor]:
    """The segment indices grouped by `ceil(length / unit)` (one int64 tensor per group, shortest
    group first, segments in order within each)."""
    units = (segment_lengths(cu_seqlens) + unit - 1) // unit
    return [torch.nonzero(units == count).flatten() for count in torch.unique(units)]


def _subset_tokens(cu_seqlens: torch.Tensor, segments: torch.Tensor, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For the tokens of `segments` (in that order): their index in the stream, and their slot
    `row · max_len + position` in the batch `pack_segments(..., segments=segments)` makes."""
    lengths = segment_lengths(cu_seqlens)[segments]
    row = torch.repeat_interleave(torch.arange(len(segments), device=cu_seqlens.device), lengths)
    first = torch.cumsum(lengths, 0) - lengths
    position = torch.arange(int(lengths.sum()), device=cu_seqlens.device) - first[row]
    return cu_seqlens[segments][row] + position, row * max_len + position


def unpack_buckets(packed: list[torch.Tensor], cu_seqlens: torch.Tensor, buckets: list[torch.Tensor]) -> torch.Tensor:
    """`[N, ...]` from one padded batch per group of segments (`pack_segments(..., segments=ids)`)."""
    if len(packed) == 1:  # one group holds every segment, in order
        return unpack_segments(packed[0], cu_seqlens)
    tokens, values = [], []
    for batch, segments in zip(packed, buckets):
        token, slot = _subset_tokens(cu_seqlens, segments, batch.shape[1])
        tokens.append(token)
        values.append(batch.reshape(-1, *batch.shape[2:]).index_select(0, slot))
    return torch.cat(values).index_select(0, torch.argsort(torch.cat(tokens)))


def pack_segments(
    x: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int | None = None, segments: torch.Tensor | None = None
) -> torch.Tensor:
    """`x [N, ...]` → `[S, max_len, ...]`: segment `s` in row `s`, zeros after its last token;
    with `segments`, only those (row `j` holds segment `segments[j]`), padded to `max_len`
    (default: their longest)."""
    if int(cu_seqlens[-1]) != x.shape[0]:
        raise ValueError(f"cu_seqlens ends at {int(cu_seqlens[-1])} but x has {x.shape[0]} tokens")
    if segments is not None and len(segments) < len(cu_seqlens) - 1:
        lengths = segment_lengths(cu_seqlens)[segments]
        max_len = int(lengths.max()) if max_len is None else max_len
        token, slot = _subset_tokens(cu_seqlens, segments, max_len)
        out = x.new_zeros(len(segments) * max_len, *x.shape[1:])
        return out.index_copy(0, slot, x.index_select(0, token)).view(len(segments), max_len, *x.shape[1:])
    max_len = max_segment_length(cu_seqlens) if max_len is None else max_len
    count = len(cu_seqlens) - 1
    if count * max_len == x.shape[0]:  # every segment full length (rows without a boundary): a view
        return x.reshape(count, max_len, *x.shape[1:])
    token, _ = _packed_index(cu_seqlens, max_len)
    padded = torch.cat([x, x.new_zeros(1, *x.shape[1:])])
    return padded.index_select(0, token).reshape(len(cu_seqlens) - 1, max_len, *x.shape[1:])


def unpack_segments(packed: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_segments`: `[S, max_len, ...]` → `[N, ...]` (the padding is dropped)."""
    segments, max_len = packed.shape[:2]
    if segments != len(cu_seqlens) - 1:
        raise ValueError(f"packed batch has {segments} rows but cu_seqlens describes {len(cu_seqlens) - 1} segments")
    if segments * max_len == int(cu_seqlens[-1]):  # no padding: the inverse of the view above
        return packed.reshape(segments * max_len, *packed.shape[2:])
    _, slot = _packed_index(cu_seqlens, max_len)
    return packed.reshape(segments * max_len, *packed.shape[2:]).index_select(0, slot)


def segment_ids(starts: torch.Tensor) -> torch.Tensor:
    """`[B, T]` int64: the index, within its row, of the segment each token belongs to (0 for
    the first); equal ids in one row mean one segment."""
    flags = starts.to(torch.int64).clone()
    flags[:, 0] = 0
    return flags.cumsum(dim=1)


__all__ = [
    "length_buckets",
    "max_segment_length",
    "pack_segments",
    "segment_ids",
    "segment_lengths",
    "segment_offsets",
    "unpack_buckets",
    "unpack_segments",
]
