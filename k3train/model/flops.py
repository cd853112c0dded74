"""Analytic parameter and FLOP counts of a K3 model, from its `ModelConfig` alone.

No model is built, so the full K3 size is counted instantly: the training loop uses
`training_flops_per_token` for MFU, planning uses both. Every count below is a closed formula of
the config (one small function per part, its formula in the docstring); `tests/unit/test_flops.py`
holds the parameter counts equal to a built model's and the FLOPs to the matmuls a forward and
backward pass executes under `torch.utils.flop_counter.FlopCounterMode`.

FLOP conventions
----------------
* A multiply-add is 2 FLOPs: `y = W x` with `W ∈ R^{m×n}` costs `2mn` per token.
* Counted: matmuls and dot products (linear layers, grouped expert GEMMs, the router, KDA's short
  depthwise convolutions and chunkwise products, MLA's `QKᵀ` and `AV`, the AttnRes scores and
  mix, the head). Not counted: elementwise work, norms, activations, softmax, gates, top-k,
  embedding lookups, the loss.
* **Training = 3 × forward**: a matmul's backward is two matmuls of its size (input and weight
  gradients). Activation recomputation is not included (these are model FLOPs, the numerator of
  MFU); `recompute: attn_res` runs the small AttnRes mix forward once more in hardware.
* **MLA attention counts the causal half** by default (`attention="causal"`): query `i` attends to
  keys `j ≤ i`, `T(T+1)/2` pairs per sequence, which is what a causal flash kernel does.
  `attention="full"` counts the whole `T×T` square, which is what PyTorch's math SDPA path
  executes (and what `FlopCounterMode` reports for it on CPU).
* **KDA counts what `kernels/kda/chunk.py`'s PyTorch chunkwise path multiplies** (the training
  path on CPU; see `kda_chunk_flops_per_token`), including the parts of each `C×C` block above
  the diagonal that it computes and then masks. The triangular solve of the UT transform is
  counted as a standard `trsm`: `n²·m` FLOPs for an `n×n` triangle and `m` right-hand sides.
  What autograd executes differs from 3 × forward by a few per cent of this part on short
  sequences (debug model, 2 chunks of 64: −2 %): the solve's backward is a solve plus a `C×C` matmul (4×, not
  3×), while the first chunk's zero state needs no gradient and the last chunk's state update,
  computed but unused without `output_final_state`, gets none.
  flash-linear-attention's Triton kernel (CUDA) tiles differently; its count is of the same order.
* Per token = per sequence divided by `seq_length`; KDA pads a sequence to whole chunks.
* **Packed documents** (`data.document_boundaries: reset`; `document_lengths`, the documents
  filling one sequence): MLA attends within each document, `Σ D(D+1)/2` pairs instead of
  `T(T+1)/2`, and KDA runs each document as its own sequence, padded to whole chunks
  (`Σ ceil(D / C)` chunks, what fla's varlen kernel tiles). MFU then counts the work done.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Literal

from k3train.contracts.stage_io import SUBLAYERS, closes_block
from k3train.model.config import ModelConfig

TRAINING_MULTIPLIER = 3
"""Forward + backward = 3 × forward (backward = input gradient + weight gradient)."""

AttentionCount = Literal["causal", "full"]


# ============================================================================ layer census
def num_mla_layers(config: ModelConfig) -> int:
    return len(config.full_attn_layer_set)


def num_kda_layers(config: ModelConfig) -> int:
    return config.num_hidden_layers - num_mla_layers(config)


def num_moe_layers(config: ModelConfig) -> int:
    return sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers))


def num_dense_layers(config: ModelConfig) -> int:
    return config.num_hidden_layers - num_moe_layers(config)


def attn_res_source_counts(config: ModelConfig) -> list[int]:
    """Sources `m` of every AttnRes call, in order: two per decoder layer, then the output one.

    Follows the wiring of `model/attn_res.py`: a sublayer mixes `[*blocks, partial]`, after the
    blocks that `contracts.stage_io.closes_block` closes before it (mixing first and pushing
    afterwards: the closed block and the fresh partial are the same sources). Empty for
    `attn_res: none`.
    """
    if config.attn_res == "none":
        return []
    blocks, counts = 0, []
    for layer in range(config.num_hidden_layers):
        for sublayer in SUBLAYERS:
            counts.append(blocks + 1)
            blocks += closes_block(config.attn_res, config.attn_res_block_size, layer, sublayer)
    counts.append(blocks + 1)  # output aggregation
    return counts


# ============================================================================ parameters
def kda_output_gate_parameters(config: ModelConfig) -> int:
    """KDA's output gate: `d·W` (full-rank g_proj) or `d·r_g + r_g·W` (low-rank g_a, g_b)."""
    width = config.linear_attn_config.num_heads * config.linear_attn_config.head_dim
    rank = config.kda_output_gate_rank
    return config.hidden_size * width if rank is None else (config.hidden_size + width) * rank


def kda_mixer_parameters(config: ModelConfig) -> int:
    """One KDA mixer, `W = H·dh`, `r` the gate rank, `κ` the short-conv kernel:
    `d·W·4 (q, k, v, g_proj) + W·d (o_proj) + 3·W·κ (convs) + d·r + r·W (f_a, f_b)
    + H (A_log) + W (dt_bias) + d·H (b_proj) + dh (o_norm)`."""
    lac = config.linear_attn_config
    d, heads, head_dim = config.hidden_size, lac.num_heads, lac.head_dim
    width, rank = heads * head_dim, config.kda_gate_rank
    return (
        3 * d * width
        + kda_output_gate_parameters(config)
        + width * d
        + 3 * width * lac.short_conv_kernel_size
        + d * rank
        + rank * width
        + heads
        + width
        + d * heads
        + head_dim
    )


def mla_mixer_parameters(config: ModelConfig) -> int:
    """One Gated MLA mixer, `H` heads, `dqk = nope + rope`:
    `q: d·q_lora + q_lora (norm) + q_lora·H·dqk` (or `d·H·dqk` without q_lora)
    `+ d·(kv_lora + rope) + kv_lora (norm) + kv_lora·H·(nope + dv) + d·H·dv (gate) + H·dv·d`."""
    d, heads, c = config.hidden_size, config.num_attention_heads, config
    if c.q_lora_rank is None:
        query = d * heads * c.qk_head_dim
    else:
        query = d * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * heads * c.qk_head_dim
    key_value = (
        d * (c.kv_lora_rank + c.qk_rope_head_dim)
        + c.kv_lora_rank
        + c.kv_lora_rank * heads * (c.qk_nope_head_dim + c.v_head_dim)
    )
    gate = d * heads * c.v_head_dim if c.mla_use_output_gate else 0
    return query + key_value + gate + heads * c.v_head_dim * d


def glu_mlp_parameters(hidden: int, intermediate: int) -> int:
    """A GLU MLP (gate, up, down): `3·d·I`."""
    return 3 * hidden * intermediate


def routed_experts_parameters(config: ModelConfig, experts: int) -> int:
    """`experts` routed experts of one layer in the latent width `dl`, inner width `I_e`:
    `experts · 3·dl·I_e`."""
    return experts * glu_mlp_parameters(config.expert_width, config.moe_intermediate_size)


def shared_experts_parameters(config: ModelConfig) -> int:
    """The shared experts of one layer, one full-width GLU MLP: `3·d·(n_shared·I_e)`."""
    return glu_mlp_parameters(config.hidden_size, config.num_shared_experts * config.moe_intermediate_size)


def latent_projection_parameters(config: ModelConfig) -> int:
    """`W_down` and `W_up` of one layer plus the latent RMSNorm: `2·d·dl (+ dl)`."""
    latent = config.routed_expert_hidden_size or 0  # null: no latent projections
    return 2 * config.hidden_size * latent + (latent if config.latent_moe_use_norm else 0)


def router_parameters(config: ModelConfig) -> int:
    """The router of one layer: `n·d` (the balancing bias is a buffer, not a parameter)."""
    return config.num_experts * config.hidden_size


def attn_res_parameters(config: ModelConfig) -> int:
    """All AttnRes pairs (query `w` and key-norm gain, `d` each): `(2·L + 1) · 2d`."""
    if config.attn_res == "none":
        return 0
    return (2 * config.num_hidden_layers + 1) * 2 * config.hidden_size


def norm_parameters(config: ModelConfig) -> int:
    """Pre-norms of both sublayers and the final norm: `(2·L + 1) · d`."""
    return (2 * config.num_hidden_layers + 1) * config.hidden_size


@dataclass(frozen=True)
class ParameterCounts:
    """Parameters per part, summed over the layers that have the part."""

    embedding: int
    head: int
    """0 with `tie_word_embeddings` (the head is the embedding matrix)."""
    kda_mixers: int
    mla_mixers: int
    dense_mlps: int
    routed_experts: int
    """All routed experts of all MoE layers."""
    routed_experts_active: int
    """The top-k of them a token uses: `routed_experts · k / n`."""
    shared_experts: int
    latent_projections: int
    """`W_down`, `W_up` and the latent RMSNorm of every MoE layer."""
    router: int
    attn_res: int
    """Queries and key-norm gains of every AttnRes pair (2 per layer + the output one)."""
    norms: int
    """Sublayer pre-norms and the final norm."""

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self) if f.name != "routed_experts_active")

    @property
    def active(self) -> int:
        """Parameters a token touches: everything except the routed experts it is not sent to."""
        return self.total - self.routed_experts + self.routed_experts_active

    @property
    def non_embedding_active(self) -> int:
        return self.active - self.embedding

    def as_dict(self) -> dict[str, int]:
        parts = {f.name: getattr(self, f.name) for f in fields(self)}
        return {**parts, "total": self.total, "active": self.active}


def parameter_counts(config: ModelConfig) -> ParameterCounts:
    """Exact parameter counts of `K3ModelChunk(config)` (the whole model, not a pipeline slice)."""
    moe_layers = num_moe_layers(config)
    embedding = config.vocab_size * config.hidden_size
    routed_total = moe_layers * routed_experts_parameters(config, config.num_experts)
    return ParameterCounts(
        embedding=embedding,
        head=0 if config.tie_word_embeddings else embedding,
        kda_mixers=num_kda_layers(config) * kda_mixer_parameters(config),
        mla_mixers=num_mla_layers(config) * mla_mixer_parameters(config),
        dense_mlps=num_dense_layers(config) * glu_mlp_parameters(config.hidden_size, config.intermediate_size),
        routed_experts=routed_total,
        routed_experts_active=moe_layers * routed_experts_parameters(config, config.num_experts_per_token),
        shared_experts=moe_layers * shared_experts_parameters(config),
        latent_projections=moe_layers * latent_projection_parameters(config),
        router=moe_layers * router_parameters(config),
        attn_res=attn_res_parameters(config),
        norms=norm_parameters(config),
    )


# ============================================================================ FLOPs (forward, per token)
def kda_projection_flops(config: ModelConfig) -> int:
    """One KDA layer's projections, forward per token: twice its projection weights,
    `2·(4·d·W + W·d + d·r + r·W + d·H)` (q, k, v, g_proj; o_proj; f_a, f_b; b_proj)."""
    lac = config.linear_attn_config
    d, heads, rank = config.hidden_size, lac.num_heads, config.kda_gate_rank
    width = heads * lac.head_dim
    return 2 * (3 * d * width + kda_output_gate_parameters(config) + width * d + d * rank + rank * width + d * heads)


def kda_short_conv_flops(config: ModelConfig) -> int:
    """The depthwise causal convolutions on q, k and v, forward per token: `3 · 2·κ·W`."""
    lac = config.linear_attn_config
    return 3 * 2 * lac.short_conv_kernel_size * lac.num_heads * lac.head_dim


def kda_chunk_flops_per_chunk(chunk: int, key_dim: int, value_dim: int) -> int:
    """Forward FLOPs of `chunk_kda`'s PyTorch path for one chunk of one head (`C`, `K`, `V`).

    The matmuls of `kernels/kda/chunk.py`, in order:
      decayed Gram matrices `A` (keys×keys) and `P` (queries×keys),
          each tile of rows against all `C` keys: 2 × 2·C²·K
      UT transform: `(I + A)⁻¹` by a triangular solve against `I_C`: C²·C (trsm)
          `u_base = T v`, `W = T (k ⊙ e^G)`:                             2·C²·V + 2·C²·K
      intra-chunk output `P u_base` and `P W`:                           2·C²·V + 2·C²·K
      across chunks: `u = u_base − W S`, `S ← e^{G_C} S + (k e^{G_C−G})ᵀ u`: 2·C·K·V + 2·C·K·V
      output from the state, `(q e^G − P W) S`:                          2·C·K·V
    total `C³ + 8·C²·K + 4·C²·V + 6·C·K·V`.
    """
    c, k, v = chunk, key_dim, value_dim
    gram = 2 * (2 * c * c * k)
    ut_transform = c * c * c + 2 * c * c * v + 2 * c * c * k
    intra_output = 2 * c * c * v + 2 * c * c * k
    state_passing = 2 * c * k * v + 2 * c * k * v
    state_output = 2 * c * k * v
    return gram + ut_transform + intra_output + state_passing + state_output


def kda_chunk_flops_per_token(
    config: ModelConfig, seq_length: int, document_lengths: Sequence[int] | None = None
) -> float:
    """One KDA layer's chunkwise recurrence, forward per token:
    `H · ceil(T / C) · per_chunk(C, dh, dh) / T` (the last chunk padded to `C` tokens); with
    `document_lengths`, `Σ ceil(D / C)` chunks (each document padded on its own)."""
    lac = config.linear_attn_config
    lengths = _documents(seq_length, document_lengths)
    chunks = sum(math.ceil(length / lac.chunk_size) for length in lengths)
    per_chunk = kda_chunk_flops_per_chunk(lac.chunk_size, lac.head_dim, lac.head_dim)
    return lac.num_heads * chunks * per_chunk / seq_length


def mla_projection_flops(config: ModelConfig) -> int:
    """One MLA layer's projections, forward per token: twice its projection weights (the latent
    norms excluded), `2·(d·q_lora + q_lora·H·dqk + d·(kv_lora + rope) + kv_lora·H·(nope + dv)
    + d·H·dv + H·dv·d)`."""
    c, d, heads = config, config.hidden_size, config.num_attention_heads
    if c.q_lora_rank is None:
        query = d * heads * c.qk_head_dim
    else:
        query = d * c.q_lora_rank + c.q_lora_rank * heads * c.qk_head_dim
    key_value = d * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank * heads * (c.qk_nope_head_dim + c.v_head_dim)
    gate = d * heads * c.v_head_dim if c.mla_use_output_gate else 0
    return 2 * (query + key_value + gate + heads * c.v_head_dim * d)


def mla_attention_flops(
    config: ModelConfig,
    seq_length: int,
    attention: AttentionCount = "causal",
    document_lengths: Sequence[int] | None = None,
) -> float:
    """`QKᵀ` and `AV` of one MLA layer, forward per token: `2·H·(dqk + dv)` per (query, key) pair,
    times the keys per query: `(T + 1)/2` on average for `causal` (the `T(T+1)/2` pairs `j ≤ i`),
    `T` for `full` (the whole square, as PyTorch's math SDPA computes it). With
    `document_lengths` each query sees its own document only: `Σ D(D+1)/2 / T` (causal) or
    `Σ D² / T` (full) keys per query."""
    if attention not in ("causal", "full"):
        raise ValueError(f"attention must be 'causal' or 'full', got {attention!r}")
    lengths = _documents(seq_length, document_lengths)
    pairs = sum(length * (length + 1) / 2 if attention == "causal" else length * length for length in lengths)
    keys_per_query = pairs / seq_length
    return 2 * config.num_attention_heads * (config.qk_head_dim + config.v_head_dim) * keys_per_query


def dense_mlp_flops(config: ModelConfig) -> int:
    """One dense GLU MLP, forward per token: `2 · 3·d·I`."""
    return 2 * glu_mlp_parameters(config.hidden_size, config.intermediate_size)


def routed_expert_flops(config: ModelConfig) -> int:
    """The top-k latent experts of one MoE layer, forward per token: `k · 2 · 3·dl·I_e`
    (whichever experts a token goes to, `N·k` rows pass through expert GEMMs in all)."""
    return 2 * routed_experts_parameters(config, config.num_experts_per_token)


def shared_expert_flops(config: ModelConfig) -> int:
    """The shared experts of one MoE layer, forward per token: `2 · 3·d·(n_shared·I_e)`."""
    return 2 * shared_experts_parameters(config)


def latent_projection_flops(config: ModelConfig) -> int:
    """`W_down` (d → dl) and `W_up` (dl → d) of one MoE layer, forward per token: `2 · 2·d·dl`."""
    return 2 * 2 * config.hidden_size * (config.routed_expert_hidden_size or 0)


def router_flops(config: ModelConfig) -> int:
    """The router logits of one MoE layer, forward per token: `2·d·n`."""
    return 2 * router_parameters(config)


def attn_res_flops(config: ModelConfig) -> int:
    """All AttnRes mixes, forward per token: per call with `m ≥ 2` sources, `2·m·d` for the scores
    `wᵀ k_i` and `2·m·d` for the mix `Σ α_i v_i` (`m = 1` is a plain copy); summed over the
    calls of `attn_res_source_counts`. The keys' RMSNorm and the softmax are elementwise."""
    return sum(4 * m * config.hidden_size for m in attn_res_source_counts(config) if m > 1)


def head_flops(config: ModelConfig) -> int:
    """The output head, forward per token: `2·d·vocab`."""
    return 2 * config.hidden_size * config.vocab_size


# ============================================================================ FLOPs (training, per token)
@dataclass(frozen=True)
class FlopBreakdown:
    """Training FLOPs per token (forward + backward = 3 × forward), summed over the layers."""

    seq_length: int
    attention: str
    """How MLA's attention was counted: 'causal' (half) or 'full' (square)."""
    kda_projections: float
    kda_short_conv: float
    kda_chunk: float
    """The chunkwise delta rule: Gram matrices, UT transform, state passing and output."""
    mla_projections: float
    mla_attention: float
    dense_mlp: float
    routed_experts: float
    shared_experts: float
    latent_projections: float
    router: float
    attn_res: float
    head: float

    PARTS = (
        "kda_projections",
        "kda_short_conv",
        "kda_chunk",
        "mla_projections",
        "mla_attention",
        "dense_mlp",
        "routed_experts",
        "shared_experts",
        "latent_projections",
        "router",
        "attn_res",
        "head",
    )

    @property
    def kda(self) -> float:
        return self.kda_projections + self.kda_short_conv + self.kda_chunk

    @property
    def mla(self) -> float:
        return self.mla_projections + self.mla_attention

    @property
    def moe(self) -> float:
        return self.routed_experts + self.shared_experts + self.latent_projections + self.router

    @property
    def total(self) -> float:
        return sum(getattr(self, name) for name in self.PARTS)

    @property
    def forward(self) -> float:
        return self.total / TRAINING_MULTIPLIER

    def as_dict(self) -> dict[str, float]:
        return {**{name: getattr(self, name) for name in self.PARTS}, "total": self.total}


def _documents(seq_length: int, document_lengths: Sequence[int] | None) -> list[int]:
    """The documents of one sequence: `[seq_length]` (one stream) unless given; they must fill it."""
    if document_lengths is None:
        return [seq_length]
    lengths = [int(length) for length in document_lengths]
    if sum(lengths) != seq_length or min(lengths, default=0) < 1:
        raise ValueError(f"document lengths {lengths} must be positive and fill a sequence of {seq_length} tokens")
    return lengths


def documents_of_length(seq_length: int, document_length: int) -> list[int]:
    """A sequence packed with documents of `document_length` tokens (the last one cut short)."""
    if document_length < 1:
        raise ValueError(f"document length must be positive, got {document_length}")
    whole, rest = divmod(seq_length, document_length)
    return [document_length] * whole + ([rest] if rest else [])


def training_flops_per_token(
    config: ModelConfig,
    seq_length: int,
    attention: AttentionCount = "causal",
    document_lengths: Sequence[int] | None = None,
) -> FlopBreakdown:
    """Model FLOPs of one training token (forward + backward = 3 × forward), per part.

    `seq_length` is the length of the sequences trained on (MLA's attention grows with it, KDA
    pads to whole chunks). `attention` picks the causal-half or full-square count for MLA.
    `document_lengths`: the documents packed into one sequence when each is kept apart
    (`data.document_boundaries: reset`); None, one stream.
    """
    if seq_length < 1:
        raise ValueError(f"seq_length must be positive, got {seq_length}")
    kda, mla = num_kda_layers(config), num_mla_layers(config)
    dense, moe = num_dense_layers(config), num_moe_layers(config)
    x = TRAINING_MULTIPLIER
    return FlopBreakdown(
        seq_length=seq_length,
        attention=attention,
        kda_projections=x * kda * kda_projection_flops(config),
        kda_short_conv=x * kda * kda_short_conv_flops(config),
        kda_chunk=x * kda * kda_chunk_flops_per_token(config, seq_length, document_lengths),
        mla_projections=x * mla * mla_projection_flops(config),
        mla_attention=x * mla * mla_attention_flops(config, seq_length, attention, document_lengths),
        dense_mlp=x * dense * dense_mlp_flops(config),
        routed_experts=x * moe * routed_expert_flops(config),
        shared_experts=x * moe * shared_expert_flops(config),
        latent_projections=x * moe * latent_projection_flops(config),
        router=x * moe * router_flops(config),
        attn_res=x * attn_res_flops(config),
        head=x * head_flops(config),
    )


# ============================================================================ printing
def _human(number: float) -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(number) >= scale:
            return f"{number / scale:.3f}{suffix}"
    return f"{number:.0f}"


def summary_table(config: ModelConfig, seq_length: int, attention: AttentionCount = "causal") -> str:
    """Parameters and training FLOPs per token, per part, as a plain-text table."""
    params = parameter_counts(config)
    flops = training_flops_per_token(config, seq_length, attention)
    layers = (
        f"{config.num_hidden_layers} layers: {num_kda_layers(config)} KDA + {num_mla_layers(config)} MLA, "
        f"{num_dense_layers(config)} dense + {num_moe_layers(config)} MoE"
    )
    lines = [f"K3 model, d={config.hidden_size}, {layers}", "", f"{'parameters':<24}{'count':>16}{'share':>9}"]
    for name, value in params.as_dict().items():
        if name in ("total", "active"):
            continue
        share = "" if name == "routed_experts_active" else f"{100 * value / params.total:8.2f}%"
        lines.append(f"  {name:<22}{value:>16,}{share:>9}")
    lines += [
        f"  {'total':<22}{params.total:>16,}  ({_human(params.total)})",
        f"  {'active per token':<22}{params.active:>16,}  ({_human(params.active)})",
        "",
        f"{'training FLOPs / token':<24}{'FLOPs':>16}{'share':>9}   (T={seq_length}, "
        f"3 × forward, MLA attention {attention})",
    ]
    for name, part_flops in flops.as_dict().items():
        if name == "total":
            continue
        lines.append(f"  {name:<22}{_human(part_flops):>16}{100 * part_flops / flops.total:8.2f}%")
    lines += [
        f"  {'total':<22}{_human(flops.total):>16}",
        f"  {'6 × active params':<22}{_human(6 * params.non_embedding_active):>16}  (non-embedding, for comparison)",
    ]
    return "\n".join(lines)
