"""The tiled decay factors of the chunkwise KDA kernel (`chunk.py`'s docstring has the math), the
decayed Gram matrices built from them, and the CPU flush-to-zero mode both chunk paths run in."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch


def diagonal_tile_size(max_decay: float, chunk_size: int, dtype: torch.dtype) -> int:
    """Largest divisor of `chunk_size` whose decay span `(tile − 1) · max_decay` fits the dtype.

    `max_decay` is the largest `|g|` of the call. The span bound 0.9·ln(finfo.max) keeps every
    tile-local factor `e^{±(G − r)}` normal (above the smallest normal number, so its reciprocal
    is finite) and every product of two of them finite, and makes anything lost to underflow
    negligible (see the module docstring).
    """
    span_limit = 0.9 * math.log(torch.finfo(dtype).max)
    for tile in range(chunk_size, 1, -1):
        if chunk_size % tile == 0 and (tile - 1) * max_decay <= span_limit:
            return tile
    return 1  # one-token tiles: every exponent is a pairwise difference G_i − G_j ≤ 0


class TiledDecay(NamedTuple):
    """Cumulative log-decay `G` of each chunk, measured from one reference point per tile."""

    to_reference: torch.Tensor  # e^{G_i − r_a}, [..., n_tiles, tile, K], compute dtype
    from_reference: torch.Tensor | None  # e^{r_a − G_i}, same shape (None if not asked for)
    reference: torch.Tensor  # r_a = G at the tile's middle token, [..., n_tiles, 1, K], float64


def tile_decay(log_decay: torch.Tensor, tile: int, dtype: torch.dtype, inverse: bool = True) -> TiledDecay:
    """Split `G` (`[..., C, K]`, float64, non-increasing along C) into tiles around references
    (`inverse=False`: without `from_reference`, for callers that divide by `to_reference`)."""
    *batch_shape, chunk, dim = log_decay.shape
    tiled = log_decay.reshape(*batch_shape, chunk // tile, tile, dim)
    middle = tile // 2
    # (.contiguous(): broadcasting against a strided slice takes a much slower kernel path)
    reference = tiled[..., middle : middle + 1, :].contiguous()
    if torch.is_grad_enabled() and log_decay.requires_grad:  # (autograd: no out=, no in-place)
        to_reference = torch.exp((tiled - reference).to(dtype))
    else:  # the same numbers in fewer passes: G − r rounded into `dtype` as it is written
        to_reference = torch.sub(tiled, reference, out=torch.empty(tiled.shape, dtype=dtype, device=tiled.device))
        to_reference.exp_()
    return TiledDecay(to_reference, to_reference.reciprocal() if inverse else None, reference)


def decayed_gram_matrices(
    rows: Sequence[torch.Tensor], key_columns: torch.Tensor, reference: torch.Tensor
) -> list[torch.Tensor]:
    """Causal decayed Gram matrices inside each chunk, assembled from tiles.

    For every `x ⊙ e^{G − r}` in `rows` returns, for `j ≤ i` (0 above the diagonal),
    `M[..., i, j] = Σ_c x[i, c] k[j, c] exp(G[i, c] − G[j, c])`.

    Args:
        rows: tiled row inputs times `TiledDecay.to_reference`, `[..., n_tiles, tile, K]`.
        key_columns: tiled keys times `TiledDecay.from_reference`, same shape.
        reference: `TiledDecay.reference`, `[..., n_tiles, 1, K]`, float64.

    Returns:
        one `[..., C, C]` matrix per entry of `rows`.
    """
    *batch_shape, n_tiles, tile, dim = key_columns.shape
    chunk = n_tiles * tile
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=key_columns.device).tril()
    causal = causal.view(n_tiles, tile, chunk)
    # Entries above the diagonal inside a tile are finite but meaningless: select them away
    # (a select, not a multiply, so nothing of them reaches the values or the gradients).
    return [
        torch.where(causal, gram, 0.0).reshape(*batch_shape, chunk, chunk)
        for gram in tiled_gram_matrices(rows, key_columns, reference)
    ]


def tiled_gram_matrices(
    rows: Sequence[torch.Tensor], key_columns: torch.Tensor, reference: torch.Tensor
) -> list[torch.Tensor]:
    """`decayed_gram_matrices` before the causal mask, as `[..., n_tiles, tile, C]` (row tile,
    row in tile, column), possibly strided views; entries above the diagonal are finite garbage.

    All `rows` go through one batched matmul (stacked along the row axis): twice the rows per
    matmul runs at a better rate, and its backward sums the key gradient in one matmul."""
    tile = key_columns.shape[-2]
    keys_seen, _ = keys_seen_from_row_tiles(key_columns, reference)
    stacked_rows = rows[0] if len(rows) == 1 else torch.cat(list(rows), dim=-2)
    grams = stacked_rows @ keys_seen.transpose(-1, -2)  # [..., n_tiles, len(rows)·tile, C]
    return list(grams.split(tile, dim=-2))


def keys_seen_from_row_tiles(
    key_columns: torch.Tensor, reference: torch.Tensor, exp_in_float64: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The keys of a chunk as each row tile sees them, `[..., n_tiles, C, K]`: key tile `b` times
    the bridge `e^{r_a − r_b}` to row tile `a` (0 for tiles after `a`), and the bridges
    `[..., a, b, K]` (None for one tile per chunk, where the keys are seen as they are).

    `exp_in_float64`: exponentiate the (float64) exponents as they are and round the bridges
    once, instead of rounding the exponents first. Besides being closer, this is much faster on
    CPU: PyTorch's vectorised fp32 exp leaves its fast path for arguments below ≈ −87 (results
    subnormal or 0) and runs over an order of magnitude slower; the float64 exp has no such cliff here. The no-grad
    path keeps the fp32 form (its numbers are the HF remote code's)."""
    *batch_shape, n_tiles, tile, dim = key_columns.shape
    if n_tiles == 1:
        return key_columns, None  # one tile per chunk: no bridges
    # Bridge e^{r_a − r_b} from key tile b to row tile a: exponent ≤ 0 for b ≤ a. Tiles after the
    # row tile are masked to −inf *before* exponentiating, so their positive exponent never is.
    reference = reference.squeeze(-2)
    bridge_exponent = reference.unsqueeze(-2) - reference.unsqueeze(-3)
    if not exp_in_float64:
        bridge_exponent = bridge_exponent.to(key_columns.dtype)
    later_tile = torch.ones(n_tiles, n_tiles, dtype=torch.bool, device=reference.device).triu(1)
    bridge = bridge_exponent.masked_fill(later_tile.unsqueeze(-1), float("-inf")).exp().to(key_columns.dtype)
    # [..., a, b, tile, K] -> [..., a, C, K].
    keys_seen = (bridge.unsqueeze(-2) * key_columns.unsqueeze(-4)).reshape(*batch_shape, n_tiles, n_tiles * tile, dim)
    return keys_seen, bridge


def causal_keys_seen(key_columns: torch.Tensor, reference: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`keys_seen_from_row_tiles(..., exp_in_float64=True)` for several tiles per chunk without
    the key tiles a row tile does not reach (b > a, seen through a bridge of 0): row tile `a`'s
    `(a + 1)·tile` keys, packed one row tile after another along the key axis,
    `[..., (1 + 2 + … + n_tiles)·tile, K]` (`causal_keys_seen_of_tile` slices it), and the bridges.
    The same numbers; ~40% less to write and to multiply by with four tiles."""
    *batch_shape, n_tiles, tile, dim = key_columns.shape
    # The bridges of `keys_seen_from_row_tiles(..., exp_in_float64=True)`, bit for bit, in fewer
    # passes: −inf added to the later tiles' exponents in place (a broadcast masked_fill is slower).
    reference = reference.squeeze(-2)
    later_tile = torch.ones(n_tiles, n_tiles, dtype=torch.bool, device=reference.device).triu(1).unsqueeze(-1)
    exponent_mask = torch.zeros(later_tile.shape, dtype=reference.dtype, device=reference.device)
    exponent_mask.masked_fill_(later_tile, float("-inf"))
    bridge = (reference.unsqueeze(-2) - reference.unsqueeze(-3)).add_(exponent_mask).exp_().to(key_columns.dtype)
    packed = torch.empty(
        *batch_shape, n_tiles * (n_tiles + 1) // 2 * tile, dim, dtype=key_columns.dtype, device=key_columns.device
    )
    for a in range(n_tiles):
        torch.mul(
            bridge[..., a, : a + 1, :].unsqueeze(-2),
            key_columns[..., : a + 1, :, :],
            out=causal_keys_seen_of_tile(packed, a, tile).unflatten(-2, (a + 1, tile)),
        )
    return packed, bridge


def causal_keys_seen_of_tile(packed: torch.Tensor, a: int, tile: int) -> torch.Tensor:
    """Row tile `a`'s keys in `causal_keys_seen`'s packing, `[..., (a + 1)·tile, K]` (a view)."""
    start = a * (a + 1) // 2 * tile
    return packed[..., start : start + (a + 1) * tile, :]


def flushes_denormals() -> bool:
    """Whether this thread's CPU flushes subnormal floats to zero (a subnormal times 2 reads 0)."""
    return bool((torch.tensor([1e-40], dtype=torch.float32) * 2).item() == 0.0)


@contextlib.contextmanager
def flushing_denormals(enabled: bool) -> Iterator[None]:
    """Flush-to-zero on this thread for the block (if `enabled` and supported), then the previous mode."""
    switched = enabled and not flushes_denormals() and torch.set_flush_denormal(True)
    try:
        yield
    finally:
        if switched:
            torch.set_flush_denormal(False)


class FlushDenormalsInBackward(torch.autograd.Function):
    """An identity on tensors that brackets a region's backward in flush-to-zero mode: placed on
    the region's outputs (`entering=True`: its backward runs first and switches the mode on) and
    on its inputs (`entering=False`: its backward runs last and restores the mode). `mode` is a
    dict the pair shares."""

    @staticmethod
    def forward(ctx, entering: bool, mode: dict, *tensors: torch.Tensor):
        ctx.entering, ctx.mode = entering, mode
        return tuple(tensor.view_as(tensor) for tensor in tensors)

    @staticmethod
    def backward(ctx, *grads):
        if ctx.entering:
            ctx.mode["switched"] = not flushes_denormals() and torch.set_flush_denormal(True)
        elif ctx.mode.pop("switched", False):
            torch.set_flush_denormal(False)
        return (None, None, *grads)


def causal_multipliers(
    chunk: int, tile: int, dtype: torch.dtype, device: torch.device, query_scale: float = 1.0
) -> torch.Tensor:
    """`[n_tiles, 2, tile, C]` in `dtype`: per row tile, 1 on the key Gram's strict lower triangle,
    `query_scale` on the query Gram's lower triangle, 0 elsewhere. Multiplying by it masks (and
    scales) in one pass; what it clears is finite (the Gram matrices' entries above the diagonal
    are bounded by the tile span, their gradients are plain products), so the product there is
    exactly 0. (A multiply, not `masked_fill_`: with a broadcast mask that runs an order of
    magnitude slower on CPU.)"""
    masks = causal_masks(chunk, tile, device)
    multipliers = masks.to(dtype)
    multipliers[:, 1].mul_(query_scale)
    return multipliers


def causal_masks(chunk: int, tile: int, device: torch.device) -> torch.Tensor:
    """`[n_tiles, 2, tile, C]`: per row tile, the strict lower triangle (the key Gram, which the
    unit-triangular solve reads below the diagonal only) and the lower triangle (the query Gram)."""
    rows = torch.arange(chunk, device=device).view(chunk // tile, 1, tile, 1)
    columns = torch.arange(chunk, device=device)
    return torch.cat([columns < rows, columns <= rows], dim=1)
