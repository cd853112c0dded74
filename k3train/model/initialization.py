"""Seeded initial values that do not depend on the layout, drawn in tiles of bounded size.

A random tensor is a sequence of rows along dim 0, cut into tiles of whole rows (at most
`tile_elements` elements, at least one row). Tile `t` comes from its own generator, seeded from
`(seed, key, t)`; tile 0 is seeded from `(seed, key)` alone, so a tensor of at most one tile has
exactly the values of one draw of the whole tensor from that seed. A rank computes only its own
part: a shard along dim 0 draws the tiles that overlap its rows, a shard along another dim draws
every tile and keeps its slice of each. Whatever the layout, the values are the same and no rank
holds more than one tile besides the parameter it fills.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

TILE_ELEMENTS = 2**24  # 64 MiB of fp32 per tile

# Fills a tile in place: (tile values, the tile's generator, index of the tile's first row).
TileFill = Callable[[torch.Tensor, torch.Generator, int], None]


def stream_seed(seed: int, key: str) -> int:
    """The generator seed of the stream named `key` (a parameter name, or name + expert index)."""
    return seed * 1_000_003 + zlib.crc32(key.encode())


def normal_fill(std: float) -> TileFill:
    def fill(values: torch.Tensor, generator: torch.Generator, first_row: int) -> None:
        values.normal_(0.0, std, generator=generator)

    return fill


def uniform_fill(bound: float) -> TileFill:
    def fill(values: torch.Tensor, generator: torch.Generator, first_row: int) -> None:
        values.uniform_(-bound, bound, generator=generator)

    return fill


@dataclass(frozen=True)
class TiledStream:
    """The random tensor of shape `full_shape` named `key`, filled tile by tile by `fill`."""

    seed: int
    key: str
    full_shape: tuple[int, ...]
    fill: TileFill
    tile_elements: int = TILE_ELEMENTS

    @property
    def tile_rows(self) -> int:
        return max(1, self.tile_elements // max(1, math.prod(self.full_shape[1:])))

    def tile(self, index: int) -> torch.Tensor:
        """Tile `index` (rows `[index · tile_rows, …)`), fp32."""
        first_row = index * self.tile_rows
        rows = min(self.tile_rows, self.full_shape[0] - first_row)
        key = self.key if index == 0 else f"{self.key}#tile{index}"
        generator = torch.Generator().manual_seed(stream_seed(self.seed, key))
        values = torch.empty((rows, *self.full_shape[1:]), dtype=torch.float32, device="cpu")  # CPU generator
        self.fill(values, generator, first_row)
        return values

    @torch.no_grad()
    def draw_into(self, out: torch.Tensor, first_row: int = 0, parts: int = 1, part: int = 0, dim: int = 1) -> None:
        """Write rows `[first_row, first_row + len(out))` into `out`; with `parts > 1`, only chunk
        `part` of `parts` along `dim` (≥ 1) of those rows, as `Tensor.chunk` cuts it."""
        end = first_row + out.shape[0]
        if end == first_row:
            return
        if not 0 <= first_row < end <= self.full_shape[0]:
            raise ValueError(f"{self.key}: rows [{first_row}, {end}) outside {self.full_shape}")
        for index in range(first_row // self.tile_rows, (end - 1) // self.tile_rows + 1):
            tile_start = index * self.tile_rows
            low, high = max(first_row, tile_start), min(end, tile_start + self.tile_rows)
            piece = self.tile(index)[low - tile_start : high - tile_start]
            if parts > 1:
                piece = piece.chunk(parts, dim)[part]
            out[low - first_row : high - first_row].copy_(piece)
            del piece  # the tile is freed before the next one is drawn: one tile alive at a time


def draw_local(
    stream: TiledStream, out: torch.Tensor, tp_rank: int, tp_size: int, partition_dim: int | None, first_row: int = 0
) -> None:
    """Fill `out`, this rank's part of the tensor that starts at row `first_row` of `stream`:
    the whole tensor (`partition_dim` None), or its TP shard `tp_rank` of `tp_size` along `partition_dim`."""
    if partition_dim is None or tp_size == 1:
        stream.draw_into(out, first_row)
    elif partition_dim == 0:
        stream.draw_into(out, first_row + tp_rank * out.shape[0])
    else:
        stream.draw_into(out, first_row, tp_size, tp_rank, partition_dim)
