"""Kimi Delta Attention's arithmetic for the bundled K3 remote code (`modeling_kimi_k3.py`):
a whole piece of sequence in k3train's chunkwise form, and one token of the recurrence for
decoding. Needs torch only."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def kda_tile_size(max_decay: float, chunk_size: int, dtype: torch.dtype) -> int:
    """Largest divisor of `chunk_size` whose decay span `(tile − 1) · max|g|` stays below
    0.9·ln(finfo.max): every tile-local factor `e^{±(G − r)}` stays finite and normal."""
    span_limit = 0.9 * math.log(torch.finfo(dtype).max)
    for tile in range(chunk_size, 1, -1):
        if chunk_size % tile == 0 and (tile - 1) * max_decay <= span_limit:
            return tile
    return 1


def chunk_kda(q, k, v, g, beta, scale: float, initial_state: torch.Tensor | None, chunk_size: int):
    """Kimi Delta Attention over a whole piece of sequence, chunkwise (k3train's training form).

    Per head, `S_t = (I − β_t k_t k_tᵀ) Diag(e^{g_t}) S_{t−1} + β_t k_t v_tᵀ`, `o_t = S_tᵀ (scale·q_t)`.
    Inside a chunk of `C` tokens with cumulative decay `G` and entering state `S_0`:
    `(I + A) u = β v − β (k ⊙ e^G) S_0` with `A_ij = β_i Σ_c k_ic k_jc e^{G_ic − G_jc}` (j < i),
    `o = (q ⊙ e^G) S_0 + P u` with `P_ij = Σ_c q_ic k_jc e^{G_ic − G_jc}` (j ≤ i), and
    `S_C = e^{G_C} ⊙ S_0 + Σ_j (k_j ⊙ e^{G_C − G_j}) u_jᵀ`. Decays are products of bounded factors
    around one reference point per tile (no fp32 overflow at g = −5 over 64 tokens). The operations
    and their order are k3train's, so fp32 results are the same numbers.

    q, k `[B, T, H, K]` (L2-normalised), v `[B, T, H, V]`, g `[B, T, H, K]` (≤ 0), beta `[B, T, H]`,
    all fp32 or float64. Returns (o `[B, T, H, V]`, the state after the last token `[B, H, K, V]`).
    """
    batch, seq_len, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    dtype = q.dtype
    if initial_state is None:
        state = q.new_zeros(batch * heads, key_dim, value_dim, dtype=dtype)
    else:
        state = initial_state.to(dtype).reshape(batch * heads, key_dim, value_dim)
    pad = (-seq_len) % chunk_size
    n_chunks = (seq_len + pad) // chunk_size

    def chunked(x):  # [B, T, H, D] -> [B*H, N, C, D]; zero padding leaves the state unchanged
        x = x.transpose(1, 2)
        if pad:
            x = F.pad(x, (0, 0, 0, pad))
        return x.reshape(batch * heads, n_chunks, chunk_size, x.shape[-1])

    def to_chunks(x):
        return chunked(x).contiguous().to(dtype)

    q_chunks, k_chunks, v_chunks = to_chunks(q), to_chunks(k), to_chunks(v)
    beta_chunks = to_chunks(beta.unsqueeze(-1))
    log_decay = torch.cumsum(chunked(g), dim=-2, dtype=torch.float64)  # G, formed in float64
    lowest, highest = torch.aminmax(g.detach())
    tile = kda_tile_size(max(-float(lowest), float(highest)), chunk_size, dtype)

    n_tiles = chunk_size // tile
    tiled_decay = log_decay.reshape(batch * heads, n_chunks, n_tiles, tile, key_dim)
    reference = tiled_decay[..., tile // 2 : tile // 2 + 1, :].contiguous()  # r: the middle token's G
    to_reference = torch.exp((tiled_decay - reference).to(dtype))  # e^{G − r}
    from_reference = to_reference.reciprocal()  # e^{r − G}

    def tiled(x):
        return x.view(batch * heads, n_chunks, n_tiles, tile, x.shape[-1])

    k_rows = tiled(k_chunks) * to_reference
    q_rows = tiled(q_chunks) * to_reference
    k_columns = tiled(k_chunks) * from_reference
    if n_tiles == 1:
        keys_seen = k_columns
    else:  # bridges e^{r_a − r_b} from key tile b to row tile a ≥ b (later tiles masked before exp)
        refs = reference.squeeze(-2)
        bridge_exponent = (refs.unsqueeze(-2) - refs.unsqueeze(-3)).to(dtype)
        later_tile = torch.ones(n_tiles, n_tiles, dtype=torch.bool, device=q.device).triu(1)
        bridge = bridge_exponent.masked_fill(later_tile.unsqueeze(-1), float("-inf")).exp()
        keys_seen = (bridge.unsqueeze(-2) * k_columns.unsqueeze(-4)).reshape(
            batch * heads, n_chunks, n_tiles, chunk_size, key_dim
        )
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    key_gram, query_gram = (
        (rows @ keys_seen.transpose(-1, -2))
        .reshape(batch * heads, n_chunks, chunk_size, chunk_size)
        .masked_fill(~causal, 0.0)
        for rows in (k_rows, q_rows)
    )
    strict_key_gram = (beta_chunks * key_gram).tril(-1)  # A
    query_gram = query_gram * scale  # P

    chunk_total = log_decay[..., -1:, :].unsqueeze(-2)  # G_C
    reference_decay = reference.to(dtype).exp()
    k_from_start = (k_rows * reference_decay).view_as(k_chunks)  # k e^{G}
    q_from_start = (q_rows * reference_decay).view_as(q_chunks)  # q e^{G}
    k_to_end = (k_columns * (chunk_total - reference).to(dtype).exp()).view_as(k_chunks).transpose(-1, -2)
    chunk_decay = chunk_total.squeeze(-2).squeeze(-2).to(dtype).exp()  # e^{G_C}

    identity = torch.eye(chunk_size, dtype=dtype, device=q.device)
    ut_transform = torch.linalg.solve_triangular(
        strict_key_gram, identity, upper=False, unitriangular=True
    ) * beta_chunks.transpose(-1, -2)
    u_base = ut_transform @ v_chunks  # u = u_base − W S_0
    w = ut_transform @ k_from_start
    o_base = query_gram @ u_base  # o = o_base + q_state S_0
    q_state = torch.baddbmm(
        q_from_start.flatten(0, 1), query_gram.flatten(0, 1), w.flatten(0, 1), beta=scale, alpha=-1.0
    ).view_as(q_chunks)
    chunk_outputs = []
    for o_base_n, q_state_n, u_base_n, w_n, k_to_end_n, chunk_decay_n in zip(
        *(x.unbind(1) for x in (o_base, q_state, u_base, w, k_to_end, chunk_decay.unsqueeze(-1)))
    ):
        chunk_outputs.append(torch.baddbmm(o_base_n, q_state_n, state))
        u = torch.baddbmm(u_base_n, w_n, state, alpha=-1.0)
        state = torch.baddbmm(state * chunk_decay_n, k_to_end_n, u)
    o = torch.stack(chunk_outputs, dim=1).reshape(batch, heads, n_chunks * chunk_size, value_dim)
    o = o[:, :, :seq_len].transpose(1, 2).contiguous()
    return o, state.reshape(batch, heads, key_dim, value_dim)


def recurrent_kda_step(q, k, v, g, beta, scale: float, state: torch.Tensor):
    """One token of the recurrence (decoding): shapes as `chunk_kda` with T = 1."""
    q, k, v, g, beta = q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0]
    state = state * g.exp().unsqueeze(-1)
    predicted = torch.einsum("bhk,bhkv->bhv", k, state)
    state = state + torch.einsum("bhk,bhv->bhkv", k, beta.unsqueeze(-1) * (v - predicted))
    return torch.einsum("bhk,bhkv->bhv", q * scale, state).unsqueeze(1), state
