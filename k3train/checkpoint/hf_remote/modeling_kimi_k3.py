"""Kimi K3 text model for `AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`.

Written by k3train's `tools/convert_checkpoint.py to-hf` beside the weights; needs torch and
transformers only (never k3train). It computes what k3train's model (`K3ModelChunk`) computes, in eval mode:
Block/Full Attention Residuals with the output aggregation (or plain residuals), Gated MLA with
NoPE, Kimi Delta Attention with the bounded (or unbounded) decay gate and a full- or low-rank
output gate, Stable LatentMoE (latent RMSNorm, SiTU-GLU or SwiGLU experts, shared experts, the
balancing bias `e_score_correction_bias` in the top-k choice). Parameter names are the hub's
(`language_model.model.…`). KDA runs a prompt in k3train's chunkwise form (the same chunk size
and the same fp32 operations, so the logits equal k3train's, not only to rounding of a different
algorithm) and each decoded token as one step of the recurrence. The cache is transformers' own
`DynamicCache`: per KDA layer a `KimiDeltaCacheLayer` (transformers' `LinearAttentionLayer`, the
recurrent state and three conv histories, that can also be cropped), per MLA layer a
`DynamicLayer`; so `generate()` (greedy, sampling, beam search, prompt lookup) and manual decode
loops drive it as they drive transformers' models. `attention_mask` marks padded positions (left
padding): KDA sees them as absent (zero input, no decay, no update), MLA masks them as keys.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.modeling_utils import slice_logits_to_keep

try:
    from .cache_kimi_k3 import KDAPiece, KimiDeltaCacheLayer
    from .configuration_kimi_k3 import KimiK3Config
    from .kda_kimi_k3 import chunk_kda, recurrent_kda_step
except ImportError:  # loaded as top-level modules (tests)
    from cache_kimi_k3 import KDAPiece, KimiDeltaCacheLayer  # type: ignore[no-redef]
    from configuration_kimi_k3 import KimiK3Config  # type: ignore[no-redef]  # same class, other import path
    from kda_kimi_k3 import chunk_kda, recurrent_kda_step  # type: ignore[no-redef]

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


class GatedRMSNorm(RMSNorm):
    """KDA's output norm and gate: `RMSNorm(o) ⊙ σ(gate)`, in k3train's order of operations."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        x32 = up(x)
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * up(self.weight)
        return (normed * torch.sigmoid(up(gate))).to(x.dtype)


@contextmanager
def hooks_fired(*modules: nn.Module) -> Iterator[None]:
    """Runs accelerate's hooks of `modules` around a block that reads their weights without calling
    them (as transformers' `force_accelerate_hooks` does): with disk or CPU offload, a module's
    weights are on its device only between its hook's `pre_forward` and `post_forward`."""
    hooks = [(module, getattr(module, "_hf_hook", None)) for module in modules]
    for module, hook in hooks:
        if hook is not None:
            hook.pre_forward(module)
    try:
        yield
    finally:
        for module, hook in reversed(hooks):
            if hook is not None:
                hook.post_forward(module, ())


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


class ShortConvolution(nn.Module):
    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))
        self.kernel = kernel

    def forward(self, x, history):
        """SiLU of the causal depthwise convolution of `x` `[B, T, C]` after the inputs `history`
        `[B, C, ≤ any]` (None: none; zeros stand for inputs before the sequence's first)."""
        channels_first = x.transpose(1, 2)
        context = channels_first.new_zeros(x.shape[0], x.shape[2], 0) if history is None else history
        context = context[..., max(context.shape[-1] - (self.kernel - 1), 0) :].to(channels_first.dtype)
        padded = torch.cat([F.pad(context, (self.kernel - 1 - context.shape[-1], 0)), channels_first], dim=-1)
        return F.silu(F.conv1d(padded, self.weight.to(x.dtype), groups=x.shape[2])).transpose(1, 2)


def padded_positions_absent(mask: torch.Tensor | None, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """`tensors` (`[B, T, …]`) with the positions where `mask` `[B, T]` is False set to zero."""
    if mask is None:
        return list(tensors)
    return [t.masked_fill(~mask.view(*mask.shape, *([1] * (t.dim() - 2))), 0.0) for t in tensors]


class KimiDeltaAttention(nn.Module):
    def __init__(self, s: TextSettings, layer_idx: int):
        super().__init__()
        lin = s.linear
        heads, head_dim, hidden = lin["num_heads"], lin["head_dim"], s.hidden_size
        width, kernel = heads * head_dim, lin.get("short_conv_kernel_size", 4)
        self.layer_idx = layer_idx
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
        self.o_norm = GatedRMSNorm(head_dim, s.rms_norm_eps)
        self.o_proj = nn.Linear(width, hidden, bias=False)

    @staticmethod
    def l2_normalize(x):
        x32 = up(x)
        return x32 * torch.rsqrt(x32.pow(2).sum(-1, keepdim=True) + 1e-6)

    def forward(self, x, key_mask: torch.Tensor | None, cache: Cache | None):
        """`key_mask` `[B, past + T]` (None: every position real): a padded position is absent,
        its input zero (so the conv tails hold zeros, as before a sequence's first token), its
        decay 0 and its update strength β 0 (the state passes it unchanged)."""
        batch, seq, _ = x.shape
        heads, dim = self.heads, self.head_dim
        token_mask = None if key_mask is None else key_mask[:, -seq:]
        (x,) = padded_positions_absent(token_mask, x)
        streams = {}
        for index, name in enumerate(("q", "k", "v")):
            conv, projected = getattr(self, f"{name}_conv1d"), getattr(self, f"{name}_proj")(x)
            history = cache.get_conv_state(self.layer_idx, index) if cache is not None else None
            streams[name] = conv(projected, history).view(batch, seq, heads, dim)
            if cache is not None:  # transformers' conv state: the last kernel − 1 inputs (all, while recording)
                cache.update_conv_state(
                    projected.transpose(1, 2), self.layer_idx, state_idx=index, conv_kernel_size=conv.kernel - 1
                )
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
        k, v, g, beta = padded_positions_absent(token_mask, k, v, g, beta)
        state = cache.get_recurrent_state(self.layer_idx) if cache is not None else None
        layer_cache = cache.layers[self.layer_idx] if cache is not None else None
        if isinstance(layer_cache, KimiDeltaCacheLayer):
            layer_cache.advance(seq)
            if layer_cache.record_past:  # assisted generation: kept for `crop`
                initial = state.clone() if state is not None else q.new_zeros(batch, heads, dim, v.shape[-1])
                layer_cache.record(KDAPiece(initial, q, k, v, g, beta, dim**-0.5, self.chunk_size))
        if seq == 1 and state is not None:  # decoding: one step of the recurrence
            o, state = recurrent_kda_step(q, k, v, g, beta, dim**-0.5, state)
        else:  # a prompt (or any piece of several tokens): chunkwise, as k3train computes it
            o, state = chunk_kda(q, k, v, g, beta, dim**-0.5, state, self.chunk_size)
        if cache is not None:
            cache.update_recurrent_state(state, self.layer_idx)
        gate = self.g_proj(x) if hasattr(self, "g_proj") else self.g_b_proj(self.g_a_proj(x))
        o = self.o_norm(o.to(x.dtype), gate.view(batch, seq, heads, dim))
        return self.o_proj(o.reshape(batch, seq, heads * dim))


class GatedMLA(nn.Module):
    def __init__(self, s: TextSettings, layer_idx: int):
        super().__init__()
        hidden, heads = s.hidden_size, s.num_attention_heads
        self.layer_idx = layer_idx
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

    def forward(self, x, key_mask: torch.Tensor | None, cache: Cache | None):
        """`key_mask` `[B, past + T]` (None: every key real): padded keys are masked; a padded
        query attends to itself only (its output is unused, and finite)."""
        batch, seq, _ = x.shape
        heads = self.heads
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(batch, seq, heads, -1).transpose(1, 2)
        compressed, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(compressed)).view(batch, seq, heads, -1)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.unsqueeze(2).expand(-1, -1, heads, -1)], dim=-1)  # NoPE: never rotated
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, H, T, D], as transformers' caches hold them
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        total = k.shape[2]
        past = total - seq
        if key_mask is None and past == 0:
            attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        else:
            query_at = torch.arange(seq, device=x.device)[:, None] + past
            key_at = torch.arange(total, device=x.device)[None]
            mask = (query_at >= key_at)[None, None]
            if key_mask is not None:
                if key_mask.shape[-1] != total:
                    raise ValueError(
                        f"attention_mask covers {key_mask.shape[-1]} positions, the cache and the input {total}: "
                        "pass the mask of every position so far (past and new tokens)"
                    )
                mask = mask & key_mask[:, None, None, :] | (query_at == key_at)[None, None]
            attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        attended = attended.transpose(1, 2)
        if hasattr(self, "g_proj"):
            attended = attended * torch.sigmoid(self.g_proj(x)).view(batch, seq, heads, -1)
        return self.o_proj(attended.reshape(batch, seq, heads * self.v_dim))


def attn_res_mix(sources, norm: RMSNorm, proj: nn.Linear) -> torch.Tensor:
    """Depth attention over `sources`: softmax of `(γ ⊙ w)ᵀ RMSNorm(v_i)` weighting the raw `v_i`.
    Computed as k3train computes it (scores as `(γ ⊙ w)ᵀ v_i` times each token's inverse RMS, no
    normalised keys formed), so the logits agree to the bit. Per token: padding never mixes in."""
    rows = [up(source) for source in sources]
    with hooks_fired(norm, proj):  # the weights are read, not called
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


class DecoderLayer(GradientCheckpointingLayer):
    def __init__(self, s: TextSettings, index: int):
        super().__init__()
        self.s, self.index = s, index
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.self_attn = GatedMLA(s, index) if s.is_mla(index) else KimiDeltaAttention(s, index)
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

    def forward(self, partial, *blocks, key_mask=None, past_key_values=None):
        """(the finished AttnRes blocks…, the running partial sum) after this layer. Tensors are
        positional, so gradient checkpointing (re-entrant or not) sees every input."""
        blocks_so_far, partial = self.sublayer(
            list(blocks),
            partial,
            "self_attention_res",
            "mixer",
            self.input_layernorm,
            lambda h: self.self_attn(h, key_mask, past_key_values),
        )
        ffn = self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp
        blocks_so_far, partial = self.sublayer(
            blocks_so_far, partial, "mlp_res", "ffn", self.post_attention_layernorm, ffn
        )
        return (*blocks_so_far, partial)


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

    def forward(self, inputs_embeds, key_mask: torch.Tensor | None, cache: Cache | None):
        blocks: list[torch.Tensor] = []
        partial = inputs_embeds
        for layer in self.layers:
            *blocks, partial = layer(partial, *blocks, key_mask=key_mask, past_key_values=cache)
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
    supports_gradient_checkpointing = True
    _no_split_modules = ["DecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]

    def _init_weights(self, module):
        pass  # every tensor comes from the checkpoint (resize_token_embeddings initialises new rows itself)


class KimiK3ForCausalLM(KimiK3PreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"language_model.lm_head.weight": "language_model.model.embed_tokens.weight"}

    def __init__(self, config: KimiK3Config):
        super().__init__(config)
        text = config.text_config
        self.settings = TextSettings(text.to_dict() if hasattr(text, "to_dict") else dict(text))
        self.language_model = KimiK3LanguageModel(self.settings)
        self.post_init()  # ties the head to the embedding when config.tie_word_embeddings

    def get_input_embeddings(self):
        return self.language_model.model.embed_tokens

    def set_input_embeddings(self, value):
        self.language_model.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.language_model.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.language_model.lm_head = new_embeddings

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,  # accepted and unused: K3's attention has no positions (NoPE)
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """transformers' causal-LM forward: `input_ids` (or `inputs_embeds`) are the tokens not yet
        in `past_key_values`; `attention_mask` `[B, past + T]` marks real (1) and padded (0)
        positions; `labels` give the shifted cross-entropy `loss` (-100 ignored);
        `logits_to_keep` computes the head on the last positions only."""
        if past_key_values is None:
            past_key_values = kwargs.pop("cache", None)  # the cache's name from transformers 5.24 on
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if past_key_values is not None and not isinstance(past_key_values, Cache):
            raise ValueError(
                f"past_key_values is a {type(past_key_values).__name__}: pass a transformers Cache, e.g. "
                "DynamicCache(config=model.config)"
            )
        if inputs_embeds is None:
            inputs_embeds = self.get_input_embeddings()(input_ids)
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        key_mask = None
        if attention_mask is not None:
            if attention_mask.dim() != 2:
                raise ValueError(
                    f"attention_mask has {attention_mask.dim()} dimensions: pass the 2-D [batch, length] mask"
                )
            if not bool(attention_mask.all()):  # an all-ones mask computes the unmasked path, to the bit
                key_mask = attention_mask.to(torch.bool)
        hidden = self.language_model.model(inputs_embeds, key_mask, past_key_values)
        logits = self.get_output_embeddings()(slice_logits_to_keep(hidden, logits_to_keep))
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=logits.shape[-1], **kwargs)
        cache_field: dict[str, Any] = {CACHE_FIELD: past_key_values}
        return CausalLMOutputWithPast(loss=loss, logits=logits, **cache_field)
