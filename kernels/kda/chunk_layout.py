"""The chunk-major layout of the chunkwise KDA training path: `[B, T, H, D]` token tensors to and
from `[N, B·H, C, D]` chunks, so the state passes write each chunk's results in place."""

from __future__ import annotations

from typing import NamedTuple

import torch


class ChunkLayout(NamedTuple):
    """`[B, T, H, D]` <-> chunk-major `[N, B·H, C, D]` (chunks of `C` tokens, the last one
    zero-padded)."""

    batch: int
    seq_len: int
    heads: int
    n_chunks: int
    chunk: int

    @classmethod
    def of(cls, x: torch.Tensor, chunk: int) -> ChunkLayout:
        batch, seq_len, heads = x.shape[:3]
        return cls(batch, seq_len, heads, -(-seq_len // chunk), chunk)

    def _pieces(self, chunked: torch.Tensor, tokens: torch.Tensor):
        """Matching views: (chunks of `chunked` [N, B·H, C, D], the same tokens of `tokens`
        [B, T, H, D]) for the full chunks and for the tail, each as [N', B, H, C', D]."""
        batch, seq_len, heads, n_chunks, chunk = self
        dim = tokens.shape[-1]
        full = seq_len // chunk
        by_chunk = chunked.view(n_chunks, batch, heads, chunk, dim)
        pieces = []
        if full:
            pieces.append(
                (
                    by_chunk[:full],
                    tokens[:, : full * chunk].reshape(batch, full, chunk, heads, dim).permute(1, 0, 3, 2, 4),
                )
            )
        if full < n_chunks:
            tail = seq_len - full * chunk
            pieces.append((by_chunk[full:, :, :, :tail], tokens[:, full * chunk :].unsqueeze(0).permute(0, 1, 3, 2, 4)))
        return pieces

    @property
    def padded(self) -> bool:
        return self.n_chunks * self.chunk != self.seq_len

    def by_chunk(self, tokens: torch.Tensor) -> torch.Tensor:
        """`[N, B, H, C, D]` view of `[B, T, H, D]` tokens (no padding: `T` a multiple of `C`), so
        an elementwise pass can read or write the token layout directly instead of a copy."""
        return tokens.unflatten(1, (self.n_chunks, self.chunk)).permute(1, 0, 3, 2, 4)

    def chunk_source(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`x` as `[N, B, H, C, D]` for reading: the token layout itself where it can be (no
        padding, already `dtype`), else a padded copy."""
        if not self.padded and x.dtype == dtype:
            return self.by_chunk(x)
        return self.to_chunks(x, dtype).unflatten(1, (self.batch, self.heads))

    def to_chunks(self, x: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
        """Contiguous `[N, B·H, C, D]` in `dtype` (or written into `out`, any strides), in one
        pass. Zero padding makes the padded tokens no-ops on the state: k = 0 and beta = 0 write
        nothing, g = 0 decays nothing; their gradients are dropped."""
        batch, seq_len, heads, n_chunks, chunk = self
        if out is None:
            out = torch.empty(n_chunks, batch * heads, chunk, x.shape[-1], dtype=dtype, device=x.device)
        if n_chunks * chunk > seq_len:
            out[-1].zero_()
        for destination, source in self._pieces(out, x):
            destination.copy_(source)
        return out

    def from_chunks(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`[B, T, H, D]` in `dtype` from `[N, B·H, C, D]`, in one pass."""
        batch, seq_len, heads = self.batch, self.seq_len, self.heads
        out = torch.empty(batch, seq_len, heads, x.shape[-1], dtype=dtype, device=x.device)
        for source, destination in self._pieces(x, out):
            destination.copy_(source)
        return out
