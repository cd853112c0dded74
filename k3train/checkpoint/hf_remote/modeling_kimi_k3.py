"""Kimi K3 text model for `AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`.

Written by k3train's `tools/convert_checkpoint.py to-hf` beside the weights; needs torch and
transformers only (never k3train). It computes what k3train's model (`K3ModelChunk`) computes, in eval mode:
Block/Full Attention Residuals with the output aggregation (or plain residuals), Gated MLA with
NoPE, Kimi Delta Attention with the bounded (or unbounded) decay gate and a full- or low-rank
output gate, Stable LatentMoE (latent RMSNorm, SiTU-GLU or SwiGLU experts, shared experts, the
balancing bias `e_score_correction_bias` in the top-k choice). Parameter names are the hub's
(`language_model.model.…`). KDA runs a prompt in k3train's chunkwise form (the same chunk size
and the same fp32 operations, so the logits equal k3train's, not only to rounding of a different
algorithm) and each decoded token as one step of the recurrence; `generate()` keeps a cache per
layer (KDA recurrent state and short-convolution tails, MLA keys and values).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

try:
    from .configuration_kimi_k3 import KimiK3Config
except ImportError:  # loaded as a top-level module (tests)
    from configuration_kimi_k3 import KimiK3Config  # type: ignore[no-redef]  # same class, other import path

LATENT_NORM_EPS = 1e-6  # MLA's q_a/kv_a layernorms
# The cache's name in model outputs and generation kwargs: `cache` from transformers 5.24 on,
# `past_key_values` before (the old name still works there, with a deprecation warning).
CACHE_FIELD = "cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} else "past_key_values"


def up(x: torch.Tensor) -> torch.Tensor:
    """fp32 or wider: norms, gates, router, mixes and the KDA recurrence never run in bf16
    (float64 stays float64, so the model can be checked in float64)."""
    return x if x.dtype == torch.float64 else x.float()


class TextSettings:
    """`text_config` with K3's meaning of every field (k3train's ModelConfig names)."""

    def __init__(self, text: dict):
        extras = dict(text.get("k3train") or {})
        linear = dict(text.get("linear_attn_config") or {})
        linear.update(extras.get("linear_attn_config") or {})
        self.text, self.extras, self.linear = text, extras, linear

    def __getattr__(self, name):
        for source in (self.extras, self.text):
            if name in source:
                return source[name]
        raise AttributeError(name)

    def get(self, name, default=None):
        for source in (self.extras, self.text):
            if name in source:
                return source[name]
        return default

    @property
    def attn_res(self) -> str:
        return self.get("attn_res", "block" if "attn_res_block_size" in self.text else "none")

    def is_mla(self, layer: int) -> bool:
        return (layer + 1) in set(self.linear.get("full_attn_layers") or [])

    def is_moe(self, layer: int) -> bool:
        return layer >= self.get("first_k_dense_replace", 1) and (self.get("num_experts", 0) or 0) > 0

    def closes_block(self, layer: int, sublayer: str) -> bool:
        if self.attn_res == "full":
            return True
        return self.attn_res == "block" and sublayer == "mixer" and layer % self.attn_res_block_size == 0


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = up(x)
        return (up(self.weight) * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps))).to(x.dtype)


def glu(settings: TextSettings, gate: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    if settings.get("hidden_act", "situ") == "silu":
        return F.silu(gate) * value
    beta, linear_beta = settings.get("activation_situ_beta", 4.0), settings.get("activation_situ_linear_beta", 25.0)
    g32, u32 = up(gate), up(value)
    return (beta * torch.tanh(g32 / beta) * torch.sigmoid(g32) * (linear_beta * torch.tanh(u32 / linear_beta))).to(
        gate.dtype
    )


class MLP(nn.Module):
    def __init__(self, settings: TextSettings, hidden: int, inner: int):
        super().__init__()
        self.settings = settings
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(glu(self.settings, self.gate_proj(x), self.up_proj(x)))


class Expert(nn.Module):
    def __init__(self, settings: TextSettings, width: int, inner: int):
        super().__init__()
        self.settings = settings
        self.w1 = nn.Linear(width, inner, bias=False)
        self.w3 = nn.Linear(width, inner, bias=False)
        self.w2 = nn.Linear(inner, width, bias=False)

    def forward(self, x):
        return self.w2(glu(self.settings, self.w1(x), self.w3(x)))


class Router(nn.Module):
    def __init__(self, s: TextSettings):
        super().__init__()
        self.s = s
        self.weight = nn.Parameter(torch.empty(s.num_experts, s.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(s.num_experts, dtype=torch.float32))

    def forward(self, x):
        scores = torch.sigmoid(F.linear(up(x), up(self.weight)))
        ids = (scores + self.e_score_correction_bias).topk(self.s.num_experts_per_token, dim=-1).indices
        weights = scores.gather(-1, ids)
        if self.s.get("moe_renormalize", True):
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return ids, weights * self.s.get("routed_scaling_factor", 1.0)


class LatentMoE(nn.Module):
    def __init__(self, s: TextSettings):
        super().__init__()
        latent = s.get("routed_expert_hidden_size")
        width = latent if latent is not None else s.hidden_size
        self.gate = Router(s)
        if latent is not None:
            self.routed_expert_down_proj = nn.Linear(s.hidden_size, latent, bias=False)
            if s.get("latent_moe_use_norm", True):
                self.routed_expert_norm = RMSNorm(latent, s.rms_norm_eps)
            self.routed_expert_up_proj = nn.Linear(latent, s.hidden_size, bias=False)
        self.experts = nn.ModuleList(Expert(s, width, s.moe_intermediate_size) for _ in range(s.num_experts))
        if s.get("num_shared_experts", 0):
            self.shared_experts = MLP(s, s.hidden_size, s.num_shared_experts * s.moe_intermediate_size)

    def forward(self, x):
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        ids, weights = self.gate(tokens)
        latent = self.routed_expert_down_proj(tokens) if hasattr(self, "routed_expert_down_proj") else tokens
        combined = torch.zeros(latent.shape, dtype=up(latent).dtype, device=latent.device)
        for expert_index, expert in enumerate(self.experts):
            token_index, slot = torch.where(ids == expert_index)
            if token_index.numel():
                out = up(expert(latent[token_index])) * weights[token_index, slot, None]
                combined.index_add_(0, token_index, out)
        routed = combined.to(latent.dtype)
        if hasattr(self, "routed_expert_norm"):
            routed = self.routed_expert_norm(routed)
        if hasattr(self, "routed_expert_up_proj"):
            routed = self.routed_expert_up_proj(routed)
        output = routed.view(shape)
        if hasattr(self, "shared_experts"):
            output = output + self.shared_experts(x)
        return output


@dataclass
class LayerCache:
    """One layer's state between calls: KDA's recurrent state and conv tails, or MLA's keys/values."""

    state: torch.Tensor | None = None
    tails: dict = field(default_factory=dict)
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None


class KimiK3Cache:
    """What `generate()` carries from step to step: one `LayerCache` per layer and the tokens seen."""

    def __init__(self, num_layers: int):
        self.layers = [LayerCache() for _ in range(num_layers)]
        self.seen = 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen


class ShortConvolution(nn.Module):
    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))
        self.kernel = kernel

    def forward(self, x, tail):
        channels_first = x.transpose(1, 2)
        if tail is None:
            tail = channels_first.new_zeros(x.shape[0], x.shape[2], self.kernel - 1)
        padded = torch.cat([tail, channels_first], dim=-1)
        out = F.conv1d(padded, self.weight.to(x.dtype), groups=x.shape[2])
        return F.silu(out).transpose(1, 2), padded[..., padded.shape[-1] - (self.kernel - 1) :]


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


class KimiDeltaAttention(nn.Module):
    def __init__(self, s: TextSettings):
        super().__init__()
        lin = s.linear
        heads, head_dim, hidden = lin["num_heads"], lin["head_dim"], s.hidden_size
        width, kernel = heads * head_dim, lin.get("short_conv_kernel_size", 4)
        self.heads, self.head_dim, self.lower_bound = heads, head_dim, lin.get("gate_lower_bound", -5.0)
        self.chunk_size = lin.get("chunk_size") or 64  # k3train's default
        for name in ("q", "k", "v"):
            setattr(self, f"{name}_proj", nn.Linear(hidden, width, bias=False))
            setattr(self, f"{name}_conv1d", ShortConvolution(width, kernel))
        rank = lin.get("gate_low_rank_dim") or head_dim
        self.f_a_proj = nn.Linear(hidden, rank, bias=False)
        self.f_b_proj = nn.Linear(rank, width, bias=False)
        # A_log as stored: [H], or wider with zero padding (`to-hf --pad-a-log` records the shape);
        # the heads' rates are its first H entries.
        self.A_log = nn.Parameter(torch.empty(lin.get("a_log_shape") or [heads]))
        self.dt_bias = nn.Parameter(torch.empty(width))
        self.b_proj = nn.Linear(hidden, heads, bias=False)
        if lin.get("use_full_rank_gate", True):
            self.g_proj = nn.Linear(hidden, width, bias=False)
        else:
            output_rank = lin.get("output_gate_rank") or head_dim
            self.g_a_proj = nn.Linear(hidden, output_rank, bias=False)
            self.g_b_proj = nn.Linear(output_rank, width, bias=False)
        self.o_norm = RMSNorm(head_dim, s.rms_norm_eps)
        self.o_proj = nn.Linear(width, hidden, bias=False)

    @staticmethod
    def l2_normalize(x):
        x32 = up(x)
        return x32 * torch.rsqrt(x32.pow(2).sum(-1, keepdim=True) + 1e-6)

    def forward(self, x, cache: LayerCache | None):
        batch, seq, _ = x.shape
        heads, dim = self.heads, self.head_dim
        tails = cache.tails if cache is not None else {}
        streams = {}
        for name in ("q", "k", "v"):
            out, tail = getattr(self, f"{name}_conv1d")(getattr(self, f"{name}_proj")(x), tails.get(name))
            streams[name], tails[name] = out.view(batch, seq, heads, dim), tail
        q, k = self.l2_normalize(streams["q"]), self.l2_normalize(streams["k"])
        v = up(streams["v"])
        z = up(self.f_b_proj(self.f_a_proj(x)).view(batch, seq, heads, dim))
        shifted = z + up(self.dt_bias).view(heads, dim)
        rate = up(self.A_log).reshape(-1)[:heads].exp().unsqueeze(-1)
        if self.lower_bound is not None:
            g = self.lower_bound * torch.sigmoid(rate * shifted)
        else:
            g = -rate * F.softplus(shifted)
        beta = torch.sigmoid(up(self.b_proj(x)))
        state = cache.state if cache is not None else None
        if seq == 1 and state is not None:  # decoding: one step of the recurrence
            o, state = recurrent_kda_step(q, k, v, g, beta, dim**-0.5, state)
        else:  # a prompt (or any piece of several tokens): chunkwise, as k3train computes it
            o, state = chunk_kda(q, k, v, g, beta, dim**-0.5, state, self.chunk_size)
        if cache is not None:
            cache.state, cache.tails = state, tails
        o = o.to(x.dtype)
        gate = self.g_proj(x) if hasattr(self, "g_proj") else self.g_b_proj(self.g_a_proj(x))
        o32 = up(o)
        normed = o32 * torch.rsqrt(o32.pow(2).mean(-1, keepdim=True) + self.o_norm.eps) * up(self.o_norm.weight)
        o = (normed * torch.sigmoid(up(gate.view(batch, seq, heads, dim)))).to(x.dtype)
        return self.o_proj(o.reshape(batch, seq, heads * dim))


class GatedMLA(nn.Module):
    def __init__(self, s: TextSettings):
        super().__init__()
        hidden, heads = s.hidden_size, s.num_attention_heads
        self.heads, self.nope, self.rope, self.v_dim = heads, s.qk_nope_head_dim, s.qk_rope_head_dim, s.v_head_dim
        self.kv_rank = s.kv_lora_rank
        qk = self.nope + self.rope
        if s.get("q_lora_rank") is None:
            self.q_proj = nn.Linear(hidden, heads * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, s.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(s.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(s.q_lora_rank, heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.kv_rank, heads * (self.nope + self.v_dim), bias=False)
        if s.get("mla_use_output_gate", True):
            self.g_proj = nn.Linear(hidden, heads * self.v_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.v_dim, hidden, bias=False)
        self.scale = qk**-0.5

    def forward(self, x, cache: LayerCache | None):
        batch, seq, _ = x.shape
        heads = self.heads
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(batch, seq, heads, -1)
        compressed, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(compressed)).view(batch, seq, heads, -1)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.unsqueeze(2).expand(-1, -1, heads, -1)], dim=-1)  # NoPE: never rotated
        past = 0
        if cache is not None:
            if cache.keys is not None:
                assert cache.values is not None, "keys and values are cached together"
                past = cache.keys.shape[1]
                k, v = torch.cat([cache.keys, k], dim=1), torch.cat([cache.values, v], dim=1)
            cache.keys, cache.values = k, v
        if past == 0:
            attended = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=self.scale
            )
        else:
            mask = torch.arange(seq, device=x.device)[:, None] + past >= torch.arange(past + seq, device=x.device)[None]
            attended = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=self.scale
            )
        attended = attended.transpose(1, 2)
        if hasattr(self, "g_proj"):
            attended = attended * torch.sigmoid(self.g_proj(x)).view(batch, seq, heads, -1)
        return self.o_proj(attended.reshape(batch, seq, heads * self.v_dim))


def attn_res_mix(sources, norm: RMSNorm, proj: nn.Linear) -> torch.Tensor:
    """Depth attention over `sources`: softmax of `(γ ⊙ w)ᵀ RMSNorm(v_i)` weighting the raw `v_i`.
    Computed as k3train computes it (scores as `(γ ⊙ w)ᵀ v_i` times each token's inverse RMS, no
    normalised keys formed), so the logits agree to the bit."""
    rows = [up(source) for source in sources]
    weight = up(norm.weight) * up(proj.weight[0])
    for row in rows:
        weight = weight.to(torch.promote_types(weight.dtype, row.dtype))
    rows = [row.to(weight.dtype) for row in rows]
    dots = torch.stack([row @ weight for row in rows])  # [m, ...]
    norms = torch.stack([torch.linalg.vector_norm(row, dim=-1) for row in rows])
    inverse_norm = torch.rsqrt(norms.square().div(weight.shape[0]).add(norm.eps))
    probabilities = (dots * inverse_norm).softmax(0).unsqueeze(-1)
    mixed = rows[0] * probabilities[0]
    for row, probability in zip(rows[1:], probabilities[1:]):
        mixed = mixed.addcmul(row, probability)
    return mixed.to(sources[0].dtype)


class DecoderLayer(nn.Module):
    def __init__(self, s: TextSettings, index: int):
        super().__init__()
        self.s, self.index = s, index
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.self_attn = GatedMLA(s) if s.is_mla(index) else KimiDeltaAttention(s)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        if s.is_moe(index):
            self.block_sparse_moe = LatentMoE(s)
        else:
            self.mlp = MLP(s, s.hidden_size, s.intermediate_size)
        if s.attn_res != "none":
            for name in ("self_attention_res", "mlp_res"):
                setattr(self, f"{name}_norm", RMSNorm(s.hidden_size, s.rms_norm_eps))
                setattr(self, f"{name}_proj", nn.Linear(s.hidden_size, 1, bias=False))

    def sublayer(self, blocks, partial, name, sublayer_kind, norm, run):
        if self.s.attn_res == "none":
            return blocks, partial + run(norm(partial))
        sources = blocks + [partial]
        mixed = (
            sources[0]
            if len(sources) == 1
            else attn_res_mix(sources, getattr(self, f"{name}_norm"), getattr(self, f"{name}_proj"))
        )
        output = run(norm(mixed))
        if self.s.closes_block(self.index, sublayer_kind):
            return blocks + [partial], output
        return blocks, partial + output

    def forward(self, blocks, partial, cache: LayerCache | None):
        blocks, partial = self.sublayer(
            blocks, partial, "self_attention_res", "mixer", self.input_layernorm, lambda h: self.self_attn(h, cache)
        )
        ffn = self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp
        return self.sublayer(blocks, partial, "mlp_res", "ffn", self.post_attention_layernorm, ffn)


class KimiK3TextModel(nn.Module):
    def __init__(self, s: TextSettings):
        super().__init__()
        self.s = s
        self.embed_tokens = nn.Embedding(s.vocab_size, s.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(s, i) for i in range(s.num_hidden_layers))
        if s.attn_res != "none":
            self.output_attn_res_norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
            self.output_attn_res_proj = nn.Linear(s.hidden_size, 1, bias=False)
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)

    def forward(self, input_ids, cache: KimiK3Cache | None):
        blocks: list[torch.Tensor] = []
        partial = self.embed_tokens(input_ids)
        for index, layer in enumerate(self.layers):
            blocks, partial = layer(blocks, partial, cache.layers[index] if cache is not None else None)
        sources = blocks + [partial]
        if self.s.attn_res == "none" or len(sources) == 1:
            return self.norm(partial if self.s.attn_res == "none" else sources[0])
        return self.norm(attn_res_mix(sources, self.output_attn_res_norm, self.output_attn_res_proj))


class KimiK3LanguageModel(nn.Module):
    def __init__(self, s: TextSettings):
        super().__init__()
        self.model = KimiK3TextModel(s)
        self.lm_head = nn.Linear(s.hidden_size, s.vocab_size, bias=False)


class KimiK3PreTrainedModel(PreTrainedModel):
    config_class = KimiK3Config
    base_model_prefix = "language_model"
    _no_split_modules = ["DecoderLayer"]

    def _init_weights(self, module):
        pass  # every tensor comes from the checkpoint


class KimiK3ForCausalLM(KimiK3PreTrainedModel, GenerationMixin):
    def __init__(self, config: KimiK3Config):
        super().__init__(config)
        text = config.text_config
        self.settings = TextSettings(text.to_dict() if hasattr(text, "to_dict") else dict(text))
        self.language_model = KimiK3LanguageModel(self.settings)
        if self.settings.get("tie_word_embeddings", False):
            self.language_model.lm_head.weight = self.language_model.model.embed_tokens.weight
        self.post_init()

    def get_input_embeddings(self):
        return self.language_model.model.embed_tokens

    def forward(self, input_ids=None, cache=None, past_key_values=None, use_cache=None, attention_mask=None, **kwargs):
        given = cache if cache is not None else past_key_values
        cache = given if isinstance(given, KimiK3Cache) else None
        if cache is None and use_cache:
            cache = KimiK3Cache(len(self.language_model.model.layers))
        if cache is not None:
            input_ids = input_ids[:, cache.seen :]  # the tokens not yet in the cache
        hidden = self.language_model.model(input_ids, cache)
        logits = self.language_model.lm_head(hidden)
        if cache is not None:
            cache.seen += input_ids.shape[1]
        return CausalLMOutputWithPast(logits=logits, **{CACHE_FIELD: cache})

    def prepare_inputs_for_generation(self, input_ids, **kwargs):
        given = kwargs.get("cache", kwargs.get("past_key_values"))
        cache = given if isinstance(given, KimiK3Cache) else None
        return {"input_ids": input_ids, CACHE_FIELD: cache, "use_cache": True}

    def _update_model_kwargs_for_generation(self, outputs, model_kwargs, *args, **kwargs):
        model_kwargs.pop("past_key_values", None)
        model_kwargs[CACHE_FIELD] = getattr(outputs, CACHE_FIELD)
        return model_kwargs
