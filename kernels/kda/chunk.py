"""Chunkwise-parallel Kimi Delta Attention (the training path of docs/design.md §1.1).

The math, per head. Split the sequence into chunks of `C` tokens. Inside one chunk let
`G_i = Σ_{s ≤ i} g_s` be the cumulative log-decay from the chunk start (per key channel) and `S_0`
the state entering the chunk. Write token t's update as `S_t = D_t S_{t−1} + k_t u_tᵀ` with
`D_t = Diag(exp(g_t))` and `u_t = β_t (v_t − k_tᵀ D_t S_{t−1})`. Unrolling the recurrence gives

    (I + A) u = β v − β (k ⊙ e^G) S_0,     A_ij = β_i Σ_c k_ic k_jc e^{G_ic − G_jc}   (j < i)
    o = (q ⊙ e^G) S_0 + P u,               P_ij = Σ_c q_ic k_jc e^{G_ic − G_jc}       (j ≤ i)
    S_C = e^{G_C} ⊙ S_0 + Σ_j (k_j ⊙ e^{G_C − G_j}) u_jᵀ

(`q` pre-multiplied by `scale`). `I + A` is unit lower triangular; applying its inverse is the
UT/WY transform, done here with `torch.linalg.solve_triangular`. Since `u` is affine in `S_0`,
`u = u_base − W S_0`, every chunk's `u_base`, `W`, `P` and output terms are computed for all
chunks at once with batched matmuls; only the state is carried across chunks, in a Python loop
of three small matmuls per chunk (no per-token loop).

The numerical range. With g ≥ −5 a 64-token chunk has `e^{G}` down to `e^{−320}`, so the textbook
factorisation `e^{G_i − G_j} = e^{G_i} · e^{−G_j}` (`Q ⊙ Γ` times `K / Γ`) underflows and
overflows in fp32. Here each chunk is cut into tiles of `tile` tokens, each with a reference
point `r` (its middle token's `G`), and every decay is a product of bounded factors:

    e^{G_i − G_j} = e^{G_i − r_a} · e^{r_a − r_b} · e^{r_b − G_j}    (i in tile a, j in tile b ≤ a)
    e^{G_i}       = e^{G_i − r_a} · e^{r_a}
    e^{G_C − G_j} = e^{r_b − G_j} · e^{G_C − r_b}

The tile-local factors `e^{±(G − r)}` span at most the tile's decay `(tile − 1)·max|g|`; every
other factor has a non-positive exponent. `tile` is the largest divisor of `C` whose span stays
below 0.9·ln(finfo.max) (≈ 80 in fp32: 16 tokens at g = −5, the whole chunk for mild gates, one
token for unbounded gates), so nothing overflows, the masked (j > i) products stay finite, and
whatever a non-positive factor loses to underflow is below e^{80 − 103} ≈ 6e-11 in absolute
terms, far under fp32 resolution. Cumulative sums and exponent differences are formed in float64
and rounded once, so nearby tokens keep full relative precision even where `G` itself is near
−320; each factor then carries a relative error of about `|exponent| · 2^−24` (≤ 2.4e-6 at
g = −5 in fp32).

Speed on CPU. The same wide range makes many products of these factors subnormal (fp32 below
1.2e-38: `e^{G_i − G_j}` of far-apart tokens), and x86 cores take a microcode assist for every
subnormal operand or result, which made the chunk's 64×64 matmuls run at a few percent of the
matmul rate. The PyTorch path therefore runs, forward and backward, with the CPU's
flush-to-zero mode on (`torch.set_flush_denormal`; values under 1.2e-38 become 0, far below what
fp32 resolves next to the O(1) terms they are added to) and restores the caller's mode after.
The mode is per thread: with several intra-op threads, the worker threads keep theirs.

The backward. Autograd through the many small operations above spends most of its time in their
elementwise backward passes. `chunk_kda` (PyTorch path, when a gradient is wanted) runs
`_ChunkKDA` instead: the same chunkwise form, reorganised for speed (its fp32 numbers agree
with the no-grad path's to rounding, not bit for bit), plus a hand-written backward that
recomputes nothing expensive and forms every gradient with batched matmuls and a few elementwise
passes (`_ChunkKDA`'s docstring has the formulas). Without a gradient (evaluation, the HF export's
checks) the plain operations above run, in the order the standalone HF remote code repeats.
`chunk_kda_autograd_reference` keeps the differentiated-by-autograd form, which the tests hold
`_ChunkKDA` to in float64 (values and gradients).

Two CPU cliffs the `_ChunkKDA` forward avoids: PyTorch's vectorised fp32 `exp` leaves its fast
path for arguments below ≈ −87 (results subnormal or 0) and runs ~60× slower, so the small
chunk- and tile-level factors with wide exponents (`e^{r}`, `e^{G_C − r}`, `e^{G_C}`, bridges) are
exponentiated in float64 and rounded once (closer, too); and it reads `q`, `k` from the caller's
token layout and its backward writes `dq`, `dk`, `dv` into it, instead of chunked copies.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, NamedTuple, Sequence

import torch
import torch.nn.functional as F

from ..precision import without_autocast
from . import fla_backend
from .naive import check_kda_inputs, compute_dtype_for


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Kimi Delta Attention, chunkwise-parallel, with flash-linear-attention's calling convention.

    Args:
        q, k: `[B, T, H, K]`, already L2-normalised by the caller.
        v: `[B, T, H, V]`.
        g: `[B, T, H, K]`, log-space decay (finite, ≤ 0).
        beta: `[B, T, H]`, write strength in (0, 1).
        scale: query scale, default `K ** -0.5`.
        initial_state: `[B, H, K, V]` state before the first token, or None for zeros.
        output_final_state: also return the state after the last token.
        chunk_size: tokens per chunk of the PyTorch path; any `T` works (padded inside).
            fla chooses its own tiling, so this does not reach the fla kernel.
        backend: "auto" (fla's Triton kernel when the tensors are on CUDA in fp32/bf16/fp16
            with K ≤ 256 and fla-core imports, else PyTorch), "torch" (always PyTorch) or
            "fla" (always fla; an error if it cannot run).

    Returns:
        `(o, final_state)`: `o` is `[B, T, H, V]` in `v.dtype`; `final_state` is `[B, H, K, V]` in
        float32 (float64 for float64 inputs on the PyTorch path), or None.
    """
    check_kda_inputs(q, k, v, g, beta, initial_state)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if fla_backend.use_fla_backend(backend, q, k, v, g, beta, initial_state):
        return fla_backend.run_fla_chunk_kda(
            q, k, v, g, beta, scale, initial_state, output_final_state
        )
    return _chunk_kda_torch(q, k, v, g, beta, scale, initial_state, output_final_state, chunk_size)


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
    subnormal or 0) and runs ~60× slower; the float64 exp has no such cliff here. The no-grad
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
    keys_seen = (bridge.unsqueeze(-2) * key_columns.unsqueeze(-4)).reshape(
        *batch_shape, n_tiles, n_tiles * tile, dim
    )
    return keys_seen, bridge


def _flushes_denormals() -> bool:
    """Whether this thread's CPU flushes subnormal floats to zero (a subnormal times 2 reads 0)."""
    return bool((torch.tensor([1e-40], dtype=torch.float32) * 2).item() == 0.0)


@contextlib.contextmanager
def _flushing_denormals(enabled: bool) -> Iterator[None]:
    """Flush-to-zero on this thread for the block (if `enabled` and supported), then the previous mode."""
    switched = enabled and not _flushes_denormals() and torch.set_flush_denormal(True)
    try:
        yield
    finally:
        if switched:
            torch.set_flush_denormal(False)


class _FlushDenormalsInBackward(torch.autograd.Function):
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
            ctx.mode["switched"] = not _flushes_denormals() and torch.set_flush_denormal(True)
        elif ctx.mode.pop("switched", False):
            torch.set_flush_denormal(False)
        return (None, None, *grads)


def chunk_kda_autograd_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The chunkwise form differentiated by autograd through its operations: the reference the
    hand-written backward of `_ChunkKDA` is tested against (arguments as `chunk_kda`, already
    validated, `scale` given). `_chunk_kda_chunks` in flush-to-zero mode on CPU, forward and
    backward (module docstring)."""
    on_cpu = q.device.type == "cpu"
    inputs = [q, k, v, g, beta] + ([initial_state] if initial_state is not None else [])
    bracket = on_cpu and torch.is_grad_enabled() and any(x.requires_grad for x in inputs)
    mode: dict = {}
    if bracket:
        inputs = list(_FlushDenormalsInBackward.apply(False, mode, *inputs))
    with _flushing_denormals(on_cpu):
        o, final_state = _chunk_kda_chunks(*inputs[:5], scale, inputs[5] if initial_state is not None else None,
                                           output_final_state, chunk_size)
    if bracket:
        if final_state is None:
            (o,) = _FlushDenormalsInBackward.apply(True, mode, o)
        else:
            o, final_state = _FlushDenormalsInBackward.apply(True, mode, o, final_state)
    return o, final_state


def _chunk_kda_chunks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The PyTorch chunkwise form; arguments as `chunk_kda`, already validated."""
    batch, seq_len, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    dtype = compute_dtype_for(q, k, v, g, beta)
    if initial_state is None:
        state = q.new_zeros(batch * heads, key_dim, value_dim, dtype=dtype)
    else:
        state = initial_state.to(dtype).reshape(batch * heads, key_dim, value_dim)
    if seq_len == 0:
        o = v.new_zeros(batch, 0, heads, value_dim)
        return o, (state.reshape(batch, heads, key_dim, value_dim) if output_final_state else None)

    pad = (-seq_len) % chunk_size
    n_chunks = (seq_len + pad) // chunk_size

    def chunked(x: torch.Tensor) -> torch.Tensor:
        """[B, T, H, D] -> [B*H, N, C, D], a view where the layout allows. Zero padding makes
        the padded tokens no-ops on the state: k = 0 and beta = 0 write nothing, g = 0 decays
        nothing."""
        x = x.transpose(1, 2)
        if pad:
            x = F.pad(x, (0, 0, 0, pad))
        return x.reshape(batch * heads, n_chunks, chunk_size, x.shape[-1])

    def to_chunks(x: torch.Tensor) -> torch.Tensor:
        """`chunked`, contiguous (elementwise ops on the transposed strides are much slower),
        in the compute dtype."""
        return chunked(x).contiguous().to(dtype)

    q_chunks, k_chunks, v_chunks = to_chunks(q), to_chunks(k), to_chunks(v)
    beta_chunks = to_chunks(beta.unsqueeze(-1))  # [BH, N, C, 1]
    log_decay = torch.cumsum(chunked(g), dim=-2, dtype=torch.float64)  # G (module docstring)

    lowest, highest = torch.aminmax(g.detach())
    max_decay = max(-float(lowest), float(highest))  # max |g|; highest ≤ 0 by contract
    tile = diagonal_tile_size(max_decay, chunk_size, dtype)
    decay = tile_decay(log_decay, tile, dtype)

    def tiled(x: torch.Tensor) -> torch.Tensor:
        return x.view(batch * heads, n_chunks, chunk_size // tile, tile, x.shape[-1])

    k_rows = tiled(k_chunks) * decay.to_reference  # k_i e^{G_i − r}
    q_rows = tiled(q_chunks) * decay.to_reference  # q_i e^{G_i − r}
    k_columns = tiled(k_chunks) * decay.from_reference  # k_j e^{r − G_j}
    key_gram, query_gram = tiled_gram_matrices([k_rows, q_rows], k_columns, decay.reference)
    # A = β ⊙ (key Gram) below the diagonal. What lies on and above it is finite and never read:
    # the solve below reads the strict lower triangle only (unit diagonal), and its backward
    # returns a strictly lower gradient, so no mask pass is needed.
    strict_key_gram = (key_gram * tiled(beta_chunks)).reshape(*beta_chunks.shape[:2], chunk_size, chunk_size)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    # P, scaled here (C×C per chunk: cheaper to scale than q); the select drops j > i.
    query_gram = torch.where(causal.view_as(query_gram[0, 0]), query_gram * scale, 0.0).reshape_as(strict_key_gram)

    # Chunk-level decays from the tile factors times small factors with exponents ≤ 0.
    chunk_total = log_decay[..., -1:, :].unsqueeze(-2)  # G_C, [BH, N, 1, 1, K]
    reference_decay = decay.reference.to(dtype).exp()  # e^{r}
    k_from_start = (k_rows * reference_decay).view_as(k_chunks)  # k e^{G}
    q_from_start = (q_rows * reference_decay).view_as(q_chunks)  # q e^{G}
    k_to_end = k_columns * (chunk_total - decay.reference).to(dtype).exp()  # k e^{G_C − G}
    k_to_end = k_to_end.view_as(k_chunks).transpose(-1, -2)  # [BH, N, K, C]
    chunk_decay = chunk_total.squeeze(-2).squeeze(-2).to(dtype).exp()  # e^{G_C}, [BH, N, K]

    # UT transform: u = (I + A)⁻¹ Diag(β) (v − (k ⊙ e^G) S_0) = u_base − W S_0. The inverse is
    # formed once per chunk (C×C right-hand sides are cheaper than K + V of them) with β folded
    # into its columns.
    identity = torch.eye(chunk_size, dtype=dtype, device=q.device)
    ut_transform = torch.linalg.solve_triangular(
        strict_key_gram, identity, upper=False, unitriangular=True
    ) * beta_chunks.transpose(-1, -2)
    u_base = ut_transform @ v_chunks
    w = ut_transform @ k_from_start
    # o = o_base + q_state S_0, with o_base = P u_base and q_state = scale (q ⊙ e^G) − P W.
    o_base = query_gram @ u_base
    q_state = torch.baddbmm(
        q_from_start.flatten(0, 1),
        query_gram.flatten(0, 1),
        w.flatten(0, 1),
        beta=scale,
        alpha=-1.0,
    ).view_as(q_chunks)

    # Across chunks: the only sequential part, three small matmuls per chunk (per-chunk views
    # taken up front with unbind: the loop is short enough for Python overhead to show).
    chunk_outputs = []
    for o_base_n, q_state_n, u_base_n, w_n, k_to_end_n, chunk_decay_n in zip(
        *(x.unbind(1) for x in (o_base, q_state, u_base, w, k_to_end, chunk_decay.unsqueeze(-1)))
    ):
        chunk_outputs.append(torch.baddbmm(o_base_n, q_state_n, state))
        u = torch.baddbmm(u_base_n, w_n, state, alpha=-1.0)
        state = torch.baddbmm(state * chunk_decay_n, k_to_end_n, u)
    o = torch.stack(chunk_outputs, dim=1)

    o = o.reshape(batch, heads, n_chunks * chunk_size, value_dim)[:, :, :seq_len]
    o = o.to(v.dtype).transpose(1, 2).contiguous()  # [B, T, H, V]
    final_state = state.reshape(batch, heads, key_dim, value_dim) if output_final_state else None
    return o, final_state


# ---------------------------------------------------------------- the training path: hand-written backward
def _chunk_kda_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The PyTorch path: `_ChunkKDA`, forward and backward in flush-to-zero mode on CPU."""
    inputs = (q, k, v, g, beta) + ((initial_state,) if initial_state is not None else ())
    if q.shape[1] == 0 or not (torch.is_grad_enabled() and any(x.requires_grad for x in inputs)):
        # Nothing to differentiate: the same forward without keeping anything for a backward.
        return chunk_kda_autograd_reference(
            q, k, v, g, beta, scale, initial_state, output_final_state, chunk_size
        )
    o, final_state = _ChunkKDA.apply(q, k, v, g, beta, initial_state, scale, chunk_size)
    return o, (final_state if output_final_state else None)


class _ChunkLayout(NamedTuple):
    """`[B, T, H, D]` <-> chunk-major `[N, B·H, C, D]` (chunks of `C` tokens, the last one
    zero-padded)."""

    batch: int
    seq_len: int
    heads: int
    n_chunks: int
    chunk: int

    @classmethod
    def of(cls, x: torch.Tensor, chunk: int) -> "_ChunkLayout":
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
            pieces.append((by_chunk[:full], tokens[:, : full * chunk].reshape(batch, full, chunk, heads, dim).permute(1, 0, 3, 2, 4)))
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


def _above_diagonal_in_tile(tile: int, device: torch.device) -> torch.Tensor:
    """`[2, tile, tile, 1]`: inside a diagonal tile block, what lies outside the key Gram (on and
    above the diagonal) and outside the query Gram (above it). With bridges, the blocks above the
    diagonal blocks are exactly 0 already (their keys are seen through a bridge of 0), so these
    are the only entries a mask has to clear (on `_diagonal_blocks`)."""
    index = torch.arange(tile, device=device)
    return torch.stack([index >= index.view(-1, 1), index > index.view(-1, 1)]).unsqueeze(-1)


def _diagonal_blocks(x: torch.Tensor, tile: int) -> torch.Tensor:
    """`[n, BH, n_tiles, (2,) tile, C]` (row tile on axis 2) -> its diagonal tile blocks as a
    view, `[n, BH, (2,) tile, tile, n_tiles]`."""
    return x.unflatten(-1, (x.shape[-1] // tile, tile)).diagonal(dim1=2, dim2=-2)


def _causal_masks(chunk: int, tile: int, device: torch.device) -> torch.Tensor:
    """`[n_tiles, 2, tile, C]`: per row tile, the strict lower triangle (the key Gram, which the
    unit-triangular solve reads below the diagonal only) and the lower triangle (the query Gram)."""
    rows = torch.arange(chunk, device=device).view(chunk // tile, 1, tile, 1)
    columns = torch.arange(chunk, device=device)
    return torch.cat([columns < rows, columns <= rows], dim=1)


class _ChunkKDA(torch.autograd.Function):
    """The chunkwise form (module docstring) with a hand-written backward.

    Forward (`_chunk_kda_forward`): the form of `_chunk_kda_chunks`, reorganised (same fp32
    numbers to rounding), keeping per chunk the state `S` entering it, the transition `F` and
    `u = u_base − W S` (`W = T (k ⊙ e^G)`, `u_base = T v`, `T = (I + A)⁻¹ Diag(β)`), besides
    the tiles, Gram matrices and `(I + A)⁻¹`.

    Backward, with `dS'` the gradient of the state leaving a chunk: the state gradients run back
    through `dS = Fᵀ dS' + q_stateᵀ do`, one matmul per chunk, where `S' = F S + (terms without
    S)`, `F = Diag(e^{G_C}) − (k ⊙ e^{G_C − G})ᵀ W` and `q_state = scale (q ⊙ e^G) − P W`; then,
    for all chunks at once, `du = Pᵀ do + (k ⊙ e^{G_C−G}) dS'`, `dy = (I + A)⁻ᵀ du`, `dv = β dy`,
    `dβ = Σ_v dy ⊙ (v − (k ⊙ e^G) S − (key Gram) u) = Σ_v dy ⊙ u / β` (the division unless a
    β is below 1e-20), and the Gram matrices' gradients
    `−dv uᵀ` (strictly lower) and `scale · do uᵀ` (lower) go back through the same tiles as the
    forward, the key side summed over row tiles by Horner's rule along the bridges. The log-decay
    gradient uses that every decay factor is `e^{±G}` of its own token: `∂L/∂G = Σ_x ±x ⊙ ∂L/∂x`
    over the factors' inputs (`+` where `G` is the row's, `−` where it is the column's, plus the
    `e^{G_C}` terms on the chunk's last token), and `dg` is its suffix sum inside the chunk.
    Everything is a few large batched matmuls and elementwise passes per call; tested against
    autograd through `_chunk_kda_chunks` in float64 (tests/unit/test_kda.py).
    """

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, scale: float, chunk_size: int):
        on_cpu = q.device.type == "cpu"
        # Autocast off: the kernel picks its own accumulation dtype (module docstring); under
        # autocast its matmuls would mix bf16 operands with its fp32 states.
        with _flushing_denormals(on_cpu), without_autocast(q.device):
            o, final_state, saved, meta = _chunk_kda_forward(
                q, k, v, g, beta, initial_state, scale, chunk_size
            )
        ctx.save_for_backward(*saved)
        ctx.meta = meta
        ctx.scale, ctx.on_cpu = scale, on_cpu
        ctx.dtypes = (q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype)
        ctx.initial_state_dtype = None if initial_state is None else initial_state.dtype
        ctx.set_materialize_grads(False)
        return o, final_state

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_o, grad_final_state):
        # Read once: under activation checkpointing each saved tensor may be unpacked only once.
        saved = ctx.saved_tensors
        with _flushing_denormals(ctx.on_cpu), without_autocast(saved[0].device):
            grads = _chunk_kda_backward(saved, ctx.meta, ctx.scale, grad_o, grad_final_state)
        dq, dk, dv, dg, dbeta, d_initial = grads
        q_dtype, k_dtype, v_dtype, g_dtype, beta_dtype = ctx.dtypes
        layout = ctx.meta["layout"]
        d_initial = (
            None if ctx.initial_state_dtype is None
            else d_initial.view(layout.batch, layout.heads, *d_initial.shape[-2:]).to(ctx.initial_state_dtype)
        )
        return (
            dq.to(q_dtype),
            dk.to(k_dtype),
            dv.to(v_dtype),
            layout.from_chunks(dg, g_dtype),
            layout.from_chunks(dbeta.unsqueeze(-1), beta_dtype).squeeze(-1),
            d_initial,
            None,
            None,
        )


def _chunk_kda_forward(q, k, v, g, beta, initial_state, scale: float, chunk_size: int):
    """`_ChunkKDA.forward`'s math: `(o, final_state, tensors to save, metadata)`.

    The same chunkwise form as `_chunk_kda_chunks` (fp32 numbers agree to rounding, not bit for
    bit), organised for speed: the chunk-local part runs in groups of about
    `_FORWARD_GROUP_MATRICES` chunk-heads (the backward slices them finer), `W` and `u_base` come from one
    matmul `T [k e^G | v]`, and the state pass is one matmul per chunk, `S' = F S + B` with the
    transition `F = Diag(e^{G_C}) − (k e^{G_C−G})ᵀ W` and `B = (k e^{G_C−G})ᵀ u_base` formed for a
    whole group at once (the backward reuses `F`). The outputs `o = P u_base + q_state S` and
    `u = u_base − W S` are then batched matmuls over each group."""
    layout = _ChunkLayout.of(q, chunk_size)
    batch, seq_len, heads, n_chunks, chunk = layout
    key_dim, value_dim = q.shape[-1], v.shape[-1]
    dtype = compute_dtype_for(q, k, v, g, beta)
    bh = batch * heads

    lowest, highest = torch.aminmax(g.detach())
    max_decay = max(-float(lowest), float(highest))  # max |g|; highest ≤ 0 by contract
    tile = diagonal_tile_size(max_decay, chunk, dtype)

    q_chunks, k_chunks = (layout.chunk_source(x, dtype) for x in (q, k))  # [N, B, H, C, K]
    # [k e^G | v] side by side, [N, BH, C, K + V]: the UT transform multiplies both in one matmul
    # (k e^G is written into the left half per group below).
    keys_values = torch.empty(n_chunks, bh, chunk, key_dim + value_dim, dtype=dtype, device=q.device)
    layout.to_chunks(v, dtype, out=keys_values[..., key_dim:])
    beta_chunks = layout.to_chunks(beta.unsqueeze(-1), dtype)  # [N, BH, C, 1]
    log_decay = layout.to_chunks(g, torch.float64).cumsum_(dim=-2)  # G (module docstring)

    # states[n]: the state entering chunk n; states[N] leaves the last chunk. The group pass
    # writes B into states[n + 1], the state pass adds F S in place.
    states = torch.empty(n_chunks + 1, bh, key_dim, value_dim, dtype=dtype, device=q.device)
    if initial_state is None:
        states[0].zero_()
    else:
        states[0].copy_(initial_state.reshape(bh, key_dim, value_dim))
    # dβ needs z = v − (k e^G) S − (key Gram) u, which is u / β (module docstring of `_ChunkKDA`):
    # unless some β is (nearly) 0, the backward divides and the masked key Gram is not kept.
    beta_divides = seq_len > 0 and float(beta.detach().amin()) >= _SMALLEST_BETA_TO_DIVIDE_BY
    group = max(1, _FORWARD_GROUP_MATRICES // bh)
    starts = range(0, n_chunks, group)
    groups = [
        _chunk_local_forward(q_chunks[s : s + group], k_chunks[s : s + group], keys_values[s : s + group],
                             beta_chunks[s : s + group], log_decay[s : s + group], states[s + 1 : s + group + 1],
                             tile=tile, scale=scale, keep_key_gram=not beta_divides)
        for s in starts
    ]
    for n in range(n_chunks):
        transition = groups[n // group]["transition"][n % group]
        torch.baddbmm(states[n + 1], transition, states[n], out=states[n + 1])

    chunk_outputs = torch.empty(n_chunks, bh, chunk, value_dim, dtype=dtype, device=q.device)
    for s, local in zip(starts, groups):
        entering = states[:-1][s : s + group].flatten(0, 1)
        outputs = chunk_outputs[s : s + group]
        torch.baddbmm(local.pop("o_base").flatten(0, 1), local["q_state"].flatten(0, 1), entering,
                      out=outputs.flatten(0, 1))
        w = local.pop("w")
        local["u"] = torch.baddbmm(local.pop("u_base").flatten(0, 1), w.flatten(0, 1), entering,
                                   alpha=-1.0).view_as(outputs)
    o = layout.from_chunks(chunk_outputs, v.dtype)
    final_state = states[-1].view(batch, heads, key_dim, value_dim).clone()

    names = list(groups[0])
    saved = [states] + [local[name] for local in groups for name in names]
    return o, final_state, saved, {"layout": layout, "tile": tile, "names": names, "group": group}


def _chunk_local_forward(q_chunks, k_chunks, keys_values, beta_chunks, log_decay, next_states,
                         tile: int, scale: float, keep_key_gram: bool) -> dict[str, torch.Tensor]:
    """The chunk-local part of `_chunk_kda_forward` for a group of chunks: the tiles, Gram
    matrices, `(I + A)⁻¹`, `[W | u_base]`, `q_state`, the transition `F` (returned) and `B`
    (written into `next_states`). Returns what the rest of the forward and the backward read
    (the masked key Gram only if `keep_key_gram`)."""
    n_chunks, batch, heads, chunk, key_dim = q_chunks.shape
    bh = batch * heads
    n_tiles = chunk // tile
    dtype = keys_values.dtype

    def tiled(x: torch.Tensor) -> torch.Tensor:
        return x.view(n_chunks, bh, n_tiles, tile, x.shape[-1])

    def by_head(x: torch.Tensor) -> torch.Tensor:  # [n, B·H, ...] -> [n, B, H, ...]
        return x.unflatten(1, (batch, heads))

    decay = tile_decay(log_decay, tile, dtype, inverse=False)
    # Rows of both Gram matrices stacked per row tile, [n, BH, n_tiles, 2·tile, K]: k e^{G − r},
    # then q e^{G − r} (written in place of a concatenation). q and k are read where they are
    # ([n, B, H, C, K], possibly the caller's token layout).
    stacked_rows = torch.empty(n_chunks, bh, n_tiles, 2 * tile, key_dim, dtype=dtype, device=q_chunks.device)
    k_rows, q_rows = stacked_rows[..., :tile, :], stacked_rows[..., tile:, :]
    k_tiles, q_tiles = (x.unflatten(3, (n_tiles, tile)) for x in (k_chunks, q_chunks))
    torch.mul(k_tiles, by_head(decay.to_reference), out=by_head(k_rows))
    torch.mul(q_tiles, by_head(decay.to_reference), out=by_head(q_rows))
    key_columns = torch.empty_like(decay.to_reference)  # k e^{r − G}, as k / e^{G − r} (one pass)
    torch.div(k_tiles, by_head(decay.to_reference), out=by_head(key_columns))
    keys_seen, bridge = keys_seen_from_row_tiles(key_columns, decay.reference, exp_in_float64=True)
    grams = stacked_rows @ keys_seen.transpose(-1, -2)  # [..., n_tiles, 2·tile, C]
    key_gram, query_gram = grams.split(tile, dim=-2)
    # A = β ⊙ (key Gram): the solve reads its strict lower triangle only, so no mask pass there;
    # the backward's copy, if it needs one, is masked (what lies on and above the diagonal is
    # finite but no Gram).
    strict_key_gram = (key_gram * tiled(beta_chunks)).reshape(n_chunks, bh, chunk, chunk)
    if keep_key_gram:
        masks = _causal_masks(chunk, tile, q_chunks.device)
        key_gram = torch.where(masks[:, 0], key_gram, 0.0).view(n_chunks, bh, chunk, chunk)
    # P, scaled here (C×C per chunk: cheaper to scale than q); the mask drops j > i (only inside
    # the diagonal tile blocks: the blocks above them are exactly 0, their keys seen through a
    # bridge of 0).
    query_gram = query_gram * scale
    _diagonal_blocks(query_gram, tile).masked_fill_(_above_diagonal_in_tile(tile, q_chunks.device)[1], 0.0)
    query_gram = query_gram.view(n_chunks, bh, chunk, chunk)

    # Chunk-level decays from the tile factors times small factors with exponents ≤ 0.
    chunk_total = log_decay[..., -1:, :].unsqueeze(-2)  # G_C, [n, BH, 1, 1, K]
    reference_decay = decay.reference.exp().to(dtype)  # e^{r} (float64 exp: see keys_seen_from_row_tiles)
    k_from_start = torch.mul(k_rows, reference_decay, out=tiled(keys_values[..., :key_dim]))  # k e^{G}
    to_end = (chunk_total - decay.reference).exp().to(dtype)  # e^{G_C − r}
    k_to_end = (key_columns * to_end).view(n_chunks, bh, chunk, key_dim).transpose(-1, -2)  # k e^{G_C − G}, [n, BH, K, C]
    chunk_decay = chunk_total.squeeze(-2).squeeze(-2).exp().to(dtype)  # e^{G_C}, [n, BH, K]

    # UT transform: u = (I + A)⁻¹ Diag(β) (v − (k ⊙ e^G) S_0) = u_base − W S_0. The inverse is
    # formed once per chunk (C×C right-hand sides are cheaper than K + V of them) and kept.
    identity = torch.eye(chunk, dtype=dtype, device=q_chunks.device)
    inverse = torch.linalg.solve_triangular(strict_key_gram, identity, upper=False, unitriangular=True)
    ut_transform = inverse * beta_chunks.transpose(-1, -2)
    w_u_base = ut_transform @ keys_values  # [W | u_base]
    w, u_base = w_u_base.split([key_dim, w_u_base.shape[-1] - key_dim], dim=-1)
    # S' = F S + B: F = Diag(e^{G_C}) − (k e^{G_C−G})ᵀ W, B = (k e^{G_C−G})ᵀ u_base.
    transition = torch.matmul(k_to_end, w).neg_()
    transition.diagonal(dim1=-2, dim2=-1).add_(chunk_decay)
    torch.bmm(k_to_end.flatten(0, 1), u_base.flatten(0, 1), out=next_states.flatten(0, 1))
    # o = o_base + q_state S, with [P W | o_base] = P [W | u_base], q_state = scale (q ⊙ e^G) − P W.
    p_w_o_base = query_gram @ w_u_base
    q_state = (q_rows * (reference_decay * scale)).view(n_chunks, bh, chunk, key_dim)
    q_state.sub_(p_w_o_base[..., :key_dim])

    local = {
        "stacked_rows": stacked_rows, "key_columns": key_columns, "keys_seen": keys_seen,
        "to_reference": decay.to_reference,
        "reference_decay": reference_decay, "to_end": to_end, "k_to_end": k_to_end,
        "chunk_decay": chunk_decay, "query_gram": query_gram, "inverse": inverse,
        "beta_chunks": beta_chunks, "v_chunks": keys_values[..., key_dim:],
        "k_from_start": k_from_start.view(n_chunks, bh, chunk, key_dim), "q_state": q_state,
        "transition": transition, "w": w, "u_base": u_base, "o_base": p_w_o_base[..., key_dim:],
    }
    if bridge is not None:
        local["bridge"] = bridge
    if keep_key_gram:
        local["key_gram"] = key_gram
    return local


def _chunk_kda_backward(saved, meta, scale: float, grad_o, grad_final_state):
    """`_ChunkKDA.backward`'s math: chunked `dq, dk, dv, dg, dbeta` and the initial state's
    gradient, `[B·H, K, V]`."""
    states, *per_group = saved
    layout, tile, names, group = meta["layout"], meta["tile"], meta["names"], meta["group"]
    groups = [dict(zip(names, per_group[i : i + len(names)])) for i in range(0, len(per_group), len(names))]
    n_chunks = states.shape[0] - 1
    _, bh, key_dim, value_dim = states.shape
    chunk = layout.chunk
    dtype = states.dtype
    device = states.device

    if grad_o is None:
        d_o = states.new_zeros(n_chunks, bh, chunk, value_dim)
    else:
        d_o = layout.to_chunks(grad_o, dtype)
    # d_states[n]: the gradient of states[n] (d_states[N]: of the final state). Back through the
    # chunks: dS = Fᵀ dS' + q_stateᵀ do, the second term for a whole group at once, in place.
    d_states = torch.empty_like(states)
    if grad_final_state is None:
        d_states[-1].zero_()
    else:
        d_states[-1].copy_(grad_final_state.reshape(bh, key_dim, value_dim))
    starts = range(0, n_chunks, group)
    for s, local in zip(starts, groups):
        torch.bmm(local["q_state"].flatten(0, 1).transpose(-1, -2), d_o[s : s + group].flatten(0, 1),
                  out=d_states[:-1][s : s + group].flatten(0, 1))
    for n in range(n_chunks - 1, -1, -1):
        transition = groups[n // group]["transition"][n % group]
        torch.baddbmm(d_states[n], transition.transpose(-1, -2), d_states[n + 1], out=d_states[n])

    # The rest is chunk by chunk: done for groups of about `_GROUP_MATRICES` chunk-heads at a time
    # (slices of the forward's groups), so that each step's operands are still in cache when the
    # next one reads them.
    # dq, dk, dv are written straight into the token layout [B, T, H, D] where there is no padding.
    def token_gradient(dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        if layout.padded:
            chunked = torch.empty(n_chunks, bh, chunk, dim, dtype=dtype, device=device)
            return chunked, chunked.unflatten(1, (layout.batch, layout.heads))
        tokens = torch.empty(layout.batch, layout.seq_len, layout.heads, dim, dtype=dtype, device=device)
        return tokens, layout.by_chunk(tokens)

    (dq, dq_chunks), (dk, dk_chunks), (dv, dv_chunks) = (token_gradient(d) for d in (key_dim, key_dim, value_dim))
    dg = torch.empty(n_chunks, bh, chunk, key_dim, dtype=dtype, device=device)
    outside = _above_diagonal_in_tile(tile, device)
    dbeta = torch.empty(n_chunks, bh, chunk, dtype=dtype, device=device)
    step = max(1, _GROUP_MATRICES // bh)
    local_names = ("stacked_rows", "key_columns", "keys_seen", "to_reference",
                   "reference_decay", "to_end", "k_to_end", "chunk_decay", "query_gram",
                   "inverse", "beta_chunks", "v_chunks", "k_from_start")
    for s, local in zip(starts, groups):
        for offset in range(0, min(group, n_chunks - s), step):
            part = slice(offset, offset + step)
            window = slice(s + offset, min(s + offset + step, s + group))
            _chunk_gradients(
                *(local[name][part] for name in local_names), states[:-1][window], local["u"][part],
                d_o[window], d_states[1:][window], dq_chunks[window], dk_chunks[window], dv_chunks[window],
                dg[window], dbeta[window], *([local["bridge"][part]] if "bridge" in local else []),
                tile=tile, scale=scale, outside=outside,
                key_gram=local["key_gram"][part] if "key_gram" in local else None,
            )
    if layout.padded:
        dq, dk, dv = (layout.from_chunks(x, dtype) for x in (dq, dk, dv))
    return dq, dk, dv, dg, dbeta, d_states[0]


_GROUP_MATRICES = 32  # chunk-heads per group of the backward's chunk-local part (≈ 0.5 MB per tensor)
# dβ divides u by β when every β of the call is at least this (below it, the products inside u
# that carry a factor β may reach the flushed-to-zero range and lose their share of u / β).
_SMALLEST_BETA_TO_DIVIDE_BY = 1e-20
# Chunk-heads per group of the forward's chunk-local part: larger (its steps are fewer and cheaper,
# so per-operation overhead weighs more than cache misses there).
_FORWARD_GROUP_MATRICES = 128


def _chunk_gradients(stacked_rows, key_columns, keys_seen, to_reference, reference_decay,
                     to_end, k_to_end, chunk_decay, query_gram, inverse, beta_chunks, v_chunks,
                     k_from_start, states, u, d_o, d_states_after, dq, dk, dv, dg, dbeta, *bridge,
                     tile: int, scale: float, outside: torch.Tensor, key_gram: torch.Tensor | None) -> None:
    """The chunk-local part of `_chunk_kda_backward` for a group of chunks (all tensors sliced
    alike along the chunk axis), writing into the group's slices of `dq, dk, dv, dg, dbeta` (the
    first three `[n, B, H, C, D]`, possibly views of the token layout). `outside`:
    `_above_diagonal_in_tile`. `key_gram`: the masked key Gram, or None for dβ through `u / β`."""
    n_chunks, bh, n_tiles, _, key_dim = stacked_rows.shape
    chunk = n_tiles * tile
    value_dim = states.shape[-1]
    dtype = stacked_rows.dtype
    k_rows, q_rows = stacked_rows.split(tile, dim=-2)

    def tiled(x: torch.Tensor) -> torch.Tensor:
        return x.view(n_chunks, bh, n_tiles, tile, x.shape[-1])

    def flat(x: torch.Tensor) -> torch.Tensor:
        return x.flatten(0, 1)

    # u = (I + A)⁻¹ y with y = β (v − (k e^G) S): du from o = P u + … and S' = … + (k e^{G_C−G})ᵀ u.
    d_u = torch.baddbmm(
        flat(k_to_end.transpose(-1, -2)) @ flat(d_states_after), flat(query_gram).transpose(-1, -2), flat(d_o)
    ).view_as(d_o)
    d_y = inverse.transpose(-1, -2) @ d_u
    batch, heads = dq.shape[1:3]

    def by_head(x: torch.Tensor) -> torch.Tensor:  # [n, B·H, ...] -> [n, B, H, ...]
        return x.unflatten(1, (batch, heads))

    torch.mul(by_head(d_y), by_head(beta_chunks), out=dv)
    # (Accumulating matmuls are written `out=` their input, not `baddbmm_`: the same in-place
    # work, and FLOP counters that know `baddbmm` see it.)
    # β enters y = β z with z = v − (k e^G) S − (key Gram) u (from (I + A) u = β (v − (k e^G) S),
    # A = Diag(β) Gram): dβ = Σ_v dy ⊙ z. The same equation reads u = β ⊙ z, so z = u / β: one
    # division instead of two matmuls, where every β is far from 0 (the padded tokens' β = 0
    # meet u = 0 and a clamped divisor: their dβ is 0, and dropped).
    if key_gram is None:
        torch.sum(u * d_y, dim=-1, out=dbeta)
        dbeta.div_(beta_chunks.squeeze(-1).clamp_min(_SMALLEST_BETA_TO_DIVIDE_BY))
    else:
        z = torch.baddbmm(flat(v_chunks), flat(k_from_start), flat(states), alpha=-1.0)
        torch.baddbmm(z, flat(key_gram), flat(u), alpha=-1.0, out=z)
        torch.sum(z.view_as(d_y) * d_y, dim=-1, out=dbeta)

    # [−dv; scale·do] per row tile, against u and S: −dv uᵀ is the key Gram's gradient
    # (dA = −dy uᵀ, A = Diag(β) Gram), scale·do uᵀ the query Gram's (masked below), −dv Sᵀ that
    # of k e^G, scale·do Sᵀ that of q e^G.
    left = torch.empty(n_chunks, bh, n_tiles, 2, tile, value_dim, dtype=dtype, device=d_o.device)
    torch.neg(dv.unflatten(3, (n_tiles, tile)), out=by_head(left[..., 0, :, :]))
    torch.mul(tiled(d_o), scale, out=left[..., 1, :, :])
    left = left.view(n_chunks, bh, 2 * chunk, value_dim)
    # (Masked in the diagonal tile blocks only: the blocks above them meet keys seen through a
    # bridge of 0 below, and the key-column sum below reads only the columns up to the row tile.)
    d_grams = (left @ u.transpose(-1, -2)).view(n_chunks, bh, n_tiles, 2, tile, chunk)
    _diagonal_blocks(d_grams, tile).masked_fill_(outside, 0.0)
    d_grams = d_grams.view(n_chunks, bh, n_tiles, 2 * tile, chunk)
    with_state = (left @ states.transpose(-1, -2)).view(n_chunks, bh, n_tiles, 2 * tile, key_dim)

    # Gradients of the tiled row inputs k e^{G−r}, q e^{G−r}: through the Gram matrices and
    # through k e^G = (k e^{G−r}) e^r, q e^G likewise.
    d_rows = with_state.mul_(reference_decay)
    rows_flat = d_rows.flatten(0, 2)
    torch.baddbmm(rows_flat, d_grams.flatten(0, 2), keys_seen.flatten(0, 2), out=rows_flat)
    d_k_rows, d_q_rows = d_rows.split(tile, dim=-2)
    # Gradients of the key columns k e^{r−G}: through the Gram matrices (summed over the row
    # tiles through their bridges) and through k e^{G_C−G} = (k e^{r−G}) e^{G_C−r}.
    # Key tile b collects Σ_{a ≥ b} e^{r_a − r_b} (row tile a's Gram gradient)ᵀ (row tile a), by
    # Horner's rule over a from the last tile: e^{r_a − r_b} = Π_{b < t ≤ a} e^{r_t − r_{t−1}}, and
    # row tile a reaches key tiles b ≤ a only (the rest of its gradient is masked to 0). No
    # [n_tiles, C, K] blow-up: each step is one matmul into the columns still open.
    d_k_to_end = u @ d_states_after.transpose(-1, -2)  # [N, BH, C, K]
    d_key_columns = torch.matmul(d_grams[..., -1, :, :].transpose(-1, -2), stacked_rows[..., -1, :, :])
    if bridge:
        steps = bridge[0].diagonal(offset=-1, dim1=-3, dim2=-2)  # e^{r_t − r_{t−1}}, [.., K, t − 1]
        for a in range(n_tiles - 2, -1, -1):
            width = (a + 1) * tile
            # (bmm into a new tensor, then add: a strided accumulator would send the matmul down
            # a per-matrix loop)
            d_key_columns[..., :width, :].mul_(steps[..., a].unsqueeze(-2)).add_(
                torch.matmul(d_grams[..., a, :, :width].transpose(-1, -2), stacked_rows[..., a, :, :])
            )
    d_key_columns = tiled(d_key_columns)
    d_key_columns.addcmul_(tiled(d_k_to_end), to_end)

    torch.mul(by_head(d_q_rows), by_head(to_reference), out=dq.unflatten(3, (n_tiles, tile)))
    torch.addcdiv(by_head(d_k_rows * to_reference), by_head(d_key_columns), by_head(to_reference),
                  out=dk.unflatten(3, (n_tiles, tile)))
    # ∂L/∂G: +x ∂L/∂x for the row-side factors e^{G−r}, −x ∂L/∂x for the column-side e^{r−G};
    # the chunk's last token also carries G_C (in e^{G_C − G} and in e^{G_C} S).
    d_log_decay = (k_rows * d_k_rows).addcmul_(q_rows, d_q_rows).addcmul_(key_columns, d_key_columns, value=-1.0)
    d_log_decay = d_log_decay.view(n_chunks, bh, chunk, key_dim)
    d_log_decay[..., -1, :] += (k_to_end.transpose(-1, -2) * d_k_to_end).sum(-2) + chunk_decay * (
        states * d_states_after
    ).sum(-1)
    # dg_s = Σ_{i ≥ s} dG_i, as one matmul with the upper-triangular ones (no flips).
    suffix_sum = torch.ones(chunk, chunk, dtype=dtype, device=d_o.device).triu()
    torch.matmul(suffix_sum, d_log_decay, out=dg)

