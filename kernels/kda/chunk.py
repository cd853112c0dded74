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
`ChunkKDA` (`chunk_training.py`) instead: the same chunkwise form, reorganised for speed (its fp32 numbers agree
with the no-grad path's to rounding, not bit for bit), plus a hand-written backward that
recomputes nothing expensive and forms every gradient with batched matmuls and a few elementwise
passes (`ChunkKDA`'s docstring has the formulas). Without a gradient (evaluation, the HF export's
checks) the plain operations above run, in the order the standalone HF remote code repeats.
`chunk_kda_autograd_reference` keeps the differentiated-by-autograd form, which the tests hold
`ChunkKDA` to in float64 (values and gradients).

Two CPU cliffs the `ChunkKDA` forward avoids: PyTorch's vectorised fp32 `exp` leaves its fast
path for arguments below ≈ −87 (results subnormal or 0) and runs over an order of magnitude slower, so the small
chunk- and tile-level factors with wide exponents (`e^{r}`, `e^{G_C − r}`, `e^{G_C}`, bridges) are
exponentiated in float64 and rounded once (closer, too); and it reads `q`, `k` from the caller's
token layout and its backward writes `dq`, `dk`, `dv` into it, instead of chunked copies.

Files: this one holds `chunk_kda` and the plain chunkwise form; `tiles.py` the tile factors, the
decayed Gram matrices and the flush-to-zero mode; `chunk_training.py` `ChunkKDA`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import fla_backend
from .chunk_training import ChunkKDA
from .naive import check_kda_inputs, compute_dtype_for
from .tiles import FlushDenormalsInBackward, diagonal_tile_size, flushing_denormals, tile_decay, tiled_gram_matrices


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
        return fla_backend.run_fla_chunk_kda(q, k, v, g, beta, scale, initial_state, output_final_state)
    return _chunk_kda_torch(q, k, v, g, beta, scale, initial_state, output_final_state, chunk_size)


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
    hand-written backward of `ChunkKDA` is tested against (arguments as `chunk_kda`, already
    validated, `scale` given). `_chunk_kda_chunks` in flush-to-zero mode on CPU, forward and
    backward (module docstring)."""
    on_cpu = q.device.type == "cpu"
    inputs = [q, k, v, g, beta] + ([initial_state] if initial_state is not None else [])
    bracket = on_cpu and torch.is_grad_enabled() and any(x.requires_grad for x in inputs)
    mode: dict = {}
    if bracket:
        inputs = list(FlushDenormalsInBackward.apply(False, mode, *inputs))
    with flushing_denormals(on_cpu):
        q_in, k_in, v_in, g_in, beta_in = inputs[:5]
        o, final_state = _chunk_kda_chunks(
            q_in,
            k_in,
            v_in,
            g_in,
            beta_in,
            scale,
            inputs[5] if initial_state is not None else None,
            output_final_state,
            chunk_size,
        )
    if bracket:
        if final_state is None:
            (o,) = FlushDenormalsInBackward.apply(True, mode, o)
        else:
            o, final_state = FlushDenormalsInBackward.apply(True, mode, o, final_state)
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
    assert decay.from_reference is not None  # tile_decay's default inverse=True computes it
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
    """The PyTorch path: `ChunkKDA`, forward and backward in flush-to-zero mode on CPU."""
    inputs = (q, k, v, g, beta) + ((initial_state,) if initial_state is not None else ())
    if q.shape[1] == 0 or not (torch.is_grad_enabled() and any(x.requires_grad for x in inputs)):
        # Nothing to differentiate: the same forward without keeping anything for a backward.
        return chunk_kda_autograd_reference(q, k, v, g, beta, scale, initial_state, output_final_state, chunk_size)
    o, final_state = ChunkKDA.apply(q, k, v, g, beta, initial_state, scale, chunk_size)
    return o, (final_state if output_final_state else None)
