"""The training path of the chunkwise KDA kernel: `ChunkKDA`, the chunkwise form reorganised for
speed with a hand-written backward (`chunk.py`'s docstring has the math and the numerical range;
`chunk_kda` dispatches here when a gradient is wanted)."""

from __future__ import annotations

import torch

from ..precision import without_autocast
from .chunk_layout import ChunkLayout
from .naive import compute_dtype_for
from .tiles import (
    causal_keys_seen,
    causal_keys_seen_of_tile,
    causal_multipliers,
    diagonal_tile_size,
    flushing_denormals,
    tile_decay,
)


class ChunkKDA(torch.autograd.Function):
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
    `e^{G_C}` terms on the chunk's last token, which add up to `Σ_v S' ⊙ dS'`), and `dg` is its
    suffix sum inside the chunk.
    Everything is a few large batched matmuls and elementwise passes per call; tested against
    autograd through `_chunk_kda_chunks` in float64 (tests/unit/test_kda.py).
    """

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, scale: float, chunk_size: int):
        on_cpu = q.device.type == "cpu"
        # Autocast off: the kernel picks its own accumulation dtype (module docstring); under
        # autocast its matmuls would mix bf16 operands with its fp32 states.
        with flushing_denormals(on_cpu), without_autocast(q.device):
            o, final_state, saved, meta = _chunk_kda_forward(q, k, v, g, beta, initial_state, scale, chunk_size)
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
        with flushing_denormals(ctx.on_cpu), without_autocast(saved[0].device):
            grads = _chunk_kda_backward(saved, ctx.meta, ctx.scale, grad_o, grad_final_state)
        dq, dk, dv, dg, dbeta, d_initial = grads
        q_dtype, k_dtype, v_dtype, g_dtype, beta_dtype = ctx.dtypes
        layout = ctx.meta["layout"]
        d_initial = (
            None
            if ctx.initial_state_dtype is None
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
    """`ChunkKDA.forward`'s math: `(o, final_state, tensors to save, metadata)`.

    The same chunkwise form as `_chunk_kda_chunks` (fp32 numbers agree to rounding, not bit for
    bit), organised for speed: the chunk-local part runs in groups of about
    `_FORWARD_GROUP_MATRICES` chunk-heads (the backward slices them finer), `W` and `u_base` come from one
    matmul `T [k e^G | v]`, and the state pass is one matmul per chunk, `S' = F S + B` with the
    transition `F = Diag(e^{G_C}) − (k e^{G_C−G})ᵀ W` and `B = (k e^{G_C−G})ᵀ u_base` formed for a
    whole group at once (the backward reuses `F`). The outputs `o = P u_base + q_state S` and
    `u = u_base − W S` are then batched matmuls over the group, before the next group starts."""
    layout = ChunkLayout.of(q, chunk_size)
    batch, seq_len, heads, n_chunks, chunk = layout
    key_dim, value_dim = q.shape[-1], v.shape[-1]
    dtype = compute_dtype_for(q, k, v, g, beta)
    bh = batch * heads

    lowest, highest = torch.aminmax(g.detach())
    max_decay = max(-float(lowest), float(highest))  # max |g|; highest ≤ 0 by contract
    tile = diagonal_tile_size(max_decay, chunk, dtype)

    # [N, B, H, C, D] views of the token layout where they can be (else padded copies).
    q_chunks, k_chunks, v_chunks = (layout.chunk_source(x, dtype) for x in (q, k, v))
    g_chunks = layout.chunk_source(g, g.dtype)
    beta_chunks = layout.to_chunks(beta.unsqueeze(-1), dtype)  # [N, BH, C, 1]

    # states[n]: the state entering chunk n; states[N] leaves the last chunk. The group pass
    # writes B into states[n + 1], the state pass adds F S in place.
    states = torch.empty(n_chunks + 1, bh, key_dim, value_dim, dtype=dtype, device=q.device)
    if initial_state is None:
        states[0].zero_()
    else:
        states[0].copy_(initial_state.reshape(bh, key_dim, value_dim))
    # dβ needs z = v − (k e^G) S − (key Gram) u, which is u / β (module docstring of `ChunkKDA`):
    # unless some β is (nearly) 0, the backward divides and the masked key Gram is not kept.
    beta_divides = seq_len > 0 and float(beta.detach().amin()) >= _SMALLEST_BETA_TO_DIVIDE_BY
    group = max(1, _FORWARD_GROUP_MATRICES // bh)
    # Group by group: the chunk-local part, the state pass through the group's chunks (it needs
    # only the state entering the group), then the group's outputs, while its tensors are still in
    # cache; what only the outputs need (W, u_base, o_base) is freed before the next group.
    state_views = states.unbind(0)  # (per-chunk views made once)
    chunk_outputs = torch.empty(n_chunks, bh, chunk, value_dim, dtype=dtype, device=q.device)
    groups = []
    for s in range(0, n_chunks, group):
        n_group = min(group, n_chunks - s)
        # Per group (not for the whole call: less fresh memory at once): [k e^G | v] side by side,
        # [n, BH, C, K + V], for the UT transform's one matmul (k e^G is written into the left half
        # by the local part), and G (module docstring), cumulated in float64.
        keys_values = torch.empty(n_group, bh, chunk, key_dim + value_dim, dtype=dtype, device=q.device)
        keys_values[..., key_dim:].unflatten(1, (batch, heads)).copy_(v_chunks[s : s + group])
        log_decay = torch.empty(n_group, bh, chunk, key_dim, dtype=torch.float64, device=q.device)
        log_decay.unflatten(1, (batch, heads)).copy_(g_chunks[s : s + group])
        local = _chunk_local_forward(
            q_chunks[s : s + group],
            k_chunks[s : s + group],
            keys_values,
            beta_chunks[s : s + group],
            log_decay.cumsum_(dim=-2),
            states[s + 1 : s + group + 1],
            tile=tile,
            scale=scale,
            keep_key_gram=not beta_divides,
        )
        for n, transition in enumerate(local["transition"].unbind(0), start=s):
            torch.baddbmm(state_views[n + 1], transition, state_views[n], out=state_views[n + 1])
        entering = states[:-1][s : s + group].flatten(0, 1)
        outputs = chunk_outputs[s : s + group]
        torch.baddbmm(
            local.pop("o_base").flatten(0, 1), local["q_state"].flatten(0, 1), entering, out=outputs.flatten(0, 1)
        )
        w = local.pop("w")
        local["u"] = torch.baddbmm(local.pop("u_base").flatten(0, 1), w.flatten(0, 1), entering, alpha=-1.0).view_as(
            outputs
        )
        groups.append(local)
    o = layout.from_chunks(chunk_outputs, v.dtype)
    final_state = states[-1].view(batch, heads, key_dim, value_dim).clone()

    names = list(groups[0])
    saved = [states] + [local[name] for local in groups for name in names]
    return o, final_state, saved, {"layout": layout, "tile": tile, "names": names, "group": group}


def _chunk_local_forward(
    q_chunks, k_chunks, keys_values, beta_chunks, log_decay, next_states, tile: int, scale: float, keep_key_gram: bool
) -> dict[str, torch.Tensor]:
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
    # A = β ⊙ (key Gram): the solve reads its strict lower triangle only, so β is not masked; the
    # backward's copy of the key Gram, if it needs one, is. P is scaled and masked (j > i dropped)
    # in the same multiply (C×C per chunk: cheaper to scale than q). What the masks clear is finite.
    multipliers = causal_multipliers(chunk, tile, dtype, q_chunks.device, scale)
    if n_tiles == 1:
        keys_seen, bridge = key_columns, None  # one tile per chunk: the keys as they are
        key_gram, query_gram = (stacked_rows @ key_columns.transpose(-1, -2)).split(tile, dim=-2)
        strict_key_gram = (key_gram * tiled(beta_chunks)).view(n_chunks, bh, chunk, chunk)
        if keep_key_gram:
            key_gram = (key_gram * multipliers[:, 0]).view(n_chunks, bh, chunk, chunk)
        query_gram = (query_gram * multipliers[:, 1]).view(n_chunks, bh, chunk, chunk)
    else:
        # Row tile a meets key tiles b ≤ a only (the later ones through a bridge of 0): one
        # matmul per row tile over its (a + 1)·tile keys, written into zeroed Gram matrices.
        keys_seen, bridge = causal_keys_seen(key_columns, decay.reference)
        strict_key_gram, query_gram, key_gram = (
            torch.zeros(n_chunks, bh, n_tiles, tile, chunk, dtype=dtype, device=q_chunks.device) if needed else None
            for needed in (True, True, keep_key_gram)
        )
        assert strict_key_gram is not None and query_gram is not None  # both always needed
        for a in range(n_tiles):
            width = (a + 1) * tile
            seen = causal_keys_seen_of_tile(keys_seen, a, tile)
            grams = torch.matmul(stacked_rows[..., a, :, :], seen.transpose(-1, -2))  # [n, BH, 2·tile, width]
            torch.mul(grams[..., :tile, :], tiled(beta_chunks)[..., a, :, :], out=strict_key_gram[..., a, :, :width])
            torch.mul(grams[..., tile:, :], multipliers[a, 1, :, :width], out=query_gram[..., a, :, :width])
            if keep_key_gram:
                assert key_gram is not None  # allocated above whenever keep_key_gram
                torch.mul(grams[..., :tile, :], multipliers[a, 0, :, :width], out=key_gram[..., a, :, :width])
        strict_key_gram, query_gram = (x.view(n_chunks, bh, chunk, chunk) for x in (strict_key_gram, query_gram))
        if keep_key_gram:
            assert key_gram is not None  # allocated above whenever keep_key_gram
            key_gram = key_gram.view(n_chunks, bh, chunk, chunk)

    # Chunk-level decays from the tile factors times small factors with exponents ≤ 0.
    chunk_total = log_decay[..., -1:, :].unsqueeze(-2)  # G_C, [n, BH, 1, 1, K]
    reference_decay = decay.reference.exp().to(dtype)  # e^{r} (float64 exp: see keys_seen_from_row_tiles)
    k_from_start = torch.mul(k_rows, reference_decay, out=tiled(keys_values[..., :key_dim]))  # k e^{G}
    to_end = (chunk_total - decay.reference).exp().to(dtype)  # e^{G_C − r}
    k_to_end = (
        (key_columns * to_end).view(n_chunks, bh, chunk, key_dim).transpose(-1, -2)
    )  # k e^{G_C − G}, [n, BH, K, C]
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
    # o = o_base + q_state S, with o_base = P u_base, q_state = scale (q ⊙ e^G) − P W (accumulated
    # by the matmul: one pass less than a subtraction).
    q_state = (q_rows * (reference_decay * scale)).view(n_chunks, bh, chunk, key_dim)
    torch.baddbmm(
        q_state.flatten(0, 1), query_gram.flatten(0, 1), w.flatten(0, 1), alpha=-1.0, out=q_state.flatten(0, 1)
    )
    o_base = query_gram @ u_base

    local = {
        "stacked_rows": stacked_rows,
        "key_columns": key_columns,
        "keys_seen": keys_seen,
        "to_reference": decay.to_reference,
        "reference_decay": reference_decay,
        "to_end": to_end,
        "k_to_end": k_to_end,
        "query_gram": query_gram,
        "inverse": inverse,
        "beta_chunks": beta_chunks,
        "q_state": q_state,
        "transition": transition,
        "w": w,
        "u_base": u_base,
        "o_base": o_base,
    }
    if bridge is not None:
        local["bridge"] = bridge
    if keep_key_gram:  # (else v and k e^G are not kept: less memory held into the backward)
        local.update(
            key_gram=key_gram,
            v_chunks=keys_values[..., key_dim:],
            k_from_start=k_from_start.view(n_chunks, bh, chunk, key_dim),
        )
    return local


def _chunk_kda_backward(saved, meta, scale: float, grad_o, grad_final_state):
    """`ChunkKDA.backward`'s math: chunked `dq, dk, dv, dg, dbeta` and the initial state's
    gradient, `[B·H, K, V]`."""
    states, *per_group = saved
    layout, tile, names, group = meta["layout"], meta["tile"], meta["names"], meta["group"]
    groups = [dict(zip(names, per_group[i : i + len(names)])) for i in range(0, len(per_group), len(names))]
    n_chunks = states.shape[0] - 1
    _, bh, key_dim, value_dim = states.shape
    chunk = layout.chunk
    dtype = states.dtype
    device = states.device

    # grad_o as [N, B, H, C, V] (a view of the token layout where it can be), copied per group.
    d_o_source = None if grad_o is None else layout.chunk_source(grad_o, dtype)
    # d_states[n]: the gradient of states[n] (d_states[N]: of the final state). Back through the
    # chunks: dS = Fᵀ dS' + q_stateᵀ do, the second term for a whole group at once, in place.
    d_states = torch.empty_like(states)
    if grad_final_state is None:
        d_states[-1].zero_()
    else:
        d_states[-1].copy_(grad_final_state.reshape(bh, key_dim, value_dim))
    d_state_views = d_states.unbind(0)  # (per-chunk views made once)

    # dq, dk, dv are written straight into the token layout [B, T, H, D] where there is no padding.
    def token_gradient(dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        if layout.padded:
            chunked = torch.empty(n_chunks, bh, chunk, dim, dtype=dtype, device=device)
            return chunked, chunked.unflatten(1, (layout.batch, layout.heads))
        tokens = torch.empty(layout.batch, layout.seq_len, layout.heads, dim, dtype=dtype, device=device)
        return tokens, layout.by_chunk(tokens)

    (dq, dq_chunks), (dk, dk_chunks), (dv, dv_chunks) = (token_gradient(d) for d in (key_dim, key_dim, value_dim))
    dg = torch.empty(n_chunks, bh, chunk, key_dim, dtype=dtype, device=device)
    causal = causal_multipliers(chunk, tile, dtype, device)
    dbeta = torch.empty(n_chunks, bh, chunk, dtype=dtype, device=device)
    step = max(1, _GROUP_MATRICES // bh)
    local_names = (
        "stacked_rows",
        "key_columns",
        "keys_seen",
        "to_reference",
        "reference_decay",
        "to_end",
        "k_to_end",
        "query_gram",
        "inverse",
        "beta_chunks",
        "v_chunks",
        "k_from_start",
    )  # the last two if kept
    per_chunk = (states[:-1], states[1:], d_states[1:], dq_chunks, dk_chunks, dv_chunks, dg, dbeta)
    # The forward's groups from the last: each one's state gradients (they need only the state
    # gradient leaving the group), then its chunk-local part, chunk by chunk in slices of about
    # `_GROUP_MATRICES` chunk-heads, so that each step's operands are still in cache when the next
    # one reads them.
    for s, local in reversed(list(zip(range(0, n_chunks, group), groups))):
        n_group = local["u"].shape[0]
        d_o = torch.empty(n_group, bh, chunk, value_dim, dtype=dtype, device=device)
        if d_o_source is None:
            d_o.zero_()
        else:
            d_o.unflatten(1, (layout.batch, layout.heads)).copy_(d_o_source[s : s + group])
        torch.bmm(
            local["q_state"].flatten(0, 1).transpose(-1, -2),
            d_o.flatten(0, 1),
            out=d_states[s : s + n_group].flatten(0, 1),
        )
        transitions = local["transition"].transpose(-1, -2).unbind(0)
        for n in range(s + n_group - 1, s - 1, -1):
            torch.baddbmm(d_state_views[n], transitions[n - s], d_state_views[n + 1], out=d_state_views[n])

        # Every argument's parts at once (one split per tensor, not one slice per part).
        u_parts, d_o_parts = local["u"].split(step), d_o.split(step)
        local_parts = [local[name].split(step) if name in local else [None] * len(u_parts) for name in local_names]
        entering, leaving, d_leaving, *outputs = (x[s : s + group].split(step) for x in per_chunk)
        bridges = local["bridge"].split(step) if "bridge" in local else None
        key_grams = local["key_gram"].split(step) if "key_gram" in local else None
        for i, local_part in enumerate(zip(*local_parts)):
            _chunk_gradients(
                *local_part,
                entering[i],
                leaving[i],
                u_parts[i],
                d_o_parts[i],
                d_leaving[i],
                *(x[i] for x in outputs),
                *([bridges[i]] if bridges else []),
                tile=tile,
                scale=scale,
                causal=causal,
                key_gram=key_grams[i] if key_grams else None,
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


def _chunk_gradients(
    stacked_rows,
    key_columns,
    keys_seen,
    to_reference,
    reference_decay,
    to_end,
    k_to_end,
    query_gram,
    inverse,
    beta_chunks,
    v_chunks,
    k_from_start,
    states,
    states_after,
    u,
    d_o,
    d_states_after,
    dq,
    dk,
    dv,
    dg,
    dbeta,
    *bridge,
    tile: int,
    scale: float,
    causal: torch.Tensor,
    key_gram: torch.Tensor | None,
) -> None:
    """The chunk-local part of `_chunk_kda_backward` for a group of chunks (all tensors sliced
    alike along the chunk axis), writing into the group's slices of `dq, dk, dv, dg, dbeta` (the
    first three `[n, B, H, C, D]`, possibly views of the token layout). `causal`:
    `causal_multipliers`. `key_gram`: the masked key Gram, or None for dβ through `u / β`."""
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
    # (Masked by one multiply over the whole row tile: cheaper than a masked_fill_ of the diagonal
    # blocks alone.)
    d_grams = (left @ u.transpose(-1, -2)).view(n_chunks, bh, n_tiles, 2, tile, chunk)
    d_grams = d_grams.mul_(causal).view(n_chunks, bh, n_tiles, 2 * tile, chunk)
    with_state = (left @ states.transpose(-1, -2)).view(n_chunks, bh, n_tiles, 2 * tile, key_dim)

    # Gradients of the tiled row inputs k e^{G−r}, q e^{G−r}: through the Gram matrices and
    # through k e^G = (k e^{G−r}) e^r, q e^G likewise.
    d_rows = with_state.mul_(reference_decay)
    if bridge:  # row tile a against its (a + 1)·tile keys (`causal_keys_seen`)
        for a in range(n_tiles):
            seen = causal_keys_seen_of_tile(keys_seen, a, tile)
            d_rows[..., a, :, :].add_(torch.matmul(d_grams[..., a, :, : seen.shape[-2]], seen))
    else:
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
    torch.addcdiv(
        by_head(d_k_rows * to_reference),
        by_head(d_key_columns),
        by_head(to_reference),
        out=dk.unflatten(3, (n_tiles, tile)),
    )
    # ∂L/∂G: +x ∂L/∂x for the row-side factors e^{G−r}, −x ∂L/∂x for the column-side e^{r−G};
    # the chunk's last token also carries G_C (in e^{G_C − G} and in e^{G_C} S).
    d_log_decay = (k_rows * d_k_rows).addcmul_(q_rows, d_q_rows).addcmul_(key_columns, d_key_columns, value=-1.0)
    d_log_decay = d_log_decay.view(n_chunks, bh, chunk, key_dim)
    # Every term of the state leaving the chunk, S' = e^{G_C} S + Σ_j e^{G_C − G_j} k_j u_jᵀ, carries
    # e^{G_C} once per key channel, so G_C's share (u held fixed) is Σ_v S' ⊙ dS': one [K, V]
    # product instead of one per factor.
    d_log_decay[..., -1, :] += (states_after * d_states_after).sum(-1)
    # dg_s = Σ_{i ≥ s} dG_i, as one matmul with the upper-triangular ones (no flips).
    suffix_sum = torch.ones(chunk, chunk, dtype=dtype, device=d_o.device).triu()
    torch.matmul(suffix_sum, d_log_decay, out=dg)
