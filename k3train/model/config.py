"""The model's configuration: Hugging Face field names wherever one exists, plus ablation switches.

`ModelConfig.preset("debug")` trains in well under a second per step on one CPU core;
`ModelConfig.preset("k3")` is the published Kimi K3 text model (build it on the meta device).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from k3train.config.field_ranges import out_of_range

FIELD_RANGES = {
    "vocab_size": "at_least_one",
    "hidden_size": "at_least_one",
    "num_hidden_layers": "at_least_one",
    "rms_norm_eps": "positive",
    "init_std": "non_negative",
    "num_attention_heads": "at_least_one",
    "q_lora_rank": "at_least_one_or_null",
    "kv_lora_rank": "at_least_one",
    "qk_nope_head_dim": "non_negative",
    "qk_rope_head_dim": "non_negative",
    "v_head_dim": "at_least_one",
    "linear_attn_config.num_heads": "at_least_one",
    "linear_attn_config.head_dim": "at_least_one",
    "linear_attn_config.short_conv_kernel_size": "at_least_one",
    "linear_attn_config.gate_low_rank_dim": "at_least_one_or_null",
    "linear_attn_config.output_gate_rank": "at_least_one_or_null",
    "linear_attn_config.chunk_size": "at_least_one",
    "activation_situ_beta": "positive",
    "activation_situ_linear_beta": "positive",
    "intermediate_size": "at_least_one",
    "num_experts": "non_negative",
    "num_shared_experts": "non_negative",
    "moe_intermediate_size": "at_least_one",
    "routed_expert_hidden_size": "at_least_one_or_null",
    "routed_scaling_factor": "positive",
    "balancer_bins": "at_least_one",
    "balancer_sign_rate": "non_negative",
    "attn_res_block_size": "at_least_one",
}
"""The range of every numeric model field (k3train/config/field_ranges.py kinds); fields that
depend on others (top-k, first_k_dense_replace, full_attn_layers) are checked in `validate`."""


@dataclass
class LinearAttnConfig:
    """Kimi Delta Attention settings (HF `linear_attn_config`)."""

    num_heads: int = 4
    """KDA heads."""
    head_dim: int = 32
    """Key and value width per KDA head."""
    short_conv_kernel_size: int = 4
    """Kernel of the causal depthwise convolution on q, k and v."""
    gate_lower_bound: float | None = -5.0
    """K3's bounded decay `g = lower_bound * sigmoid(exp(A_log) * z)`; null for Kimi Linear's
    unbounded `-exp(A_log) * softplus(z)`."""
    gate_low_rank_dim: int | None = None
    """Width of the low-rank gate input `f_b(f_a(x))`; null means `head_dim` (as in K3)."""
    output_gate: Literal["full", "low_rank"] = "full"
    """The output gate `sigmoid(g(x))` on the normalised heads: K3's full-rank `g_proj`, or Kimi
    Linear's low-rank `g_b_proj(g_a_proj(x))` (HF `use_full_rank_gate` true / false)."""
    output_gate_rank: int | None = None
    """Inner width of the low-rank output gate; null means `head_dim` (as in Kimi Linear)."""
    full_attn_layers: list[int] | None = None
    """1-based decoder layers that use Gated MLA instead of KDA; null means every 4th layer and
    the last one (K3's pattern)."""
    chunk_size: int = 64
    """Chunk length of the chunkwise-parallel KDA kernel."""


@dataclass
class ModelConfig:
    """Architecture of a K3-style decoder (docs/design.md §1)."""

    vocab_size: int = 384
    """Embedding and head rows (padded vocabulary)."""
    hidden_size: int = 128
    """Model width `d`."""
    num_hidden_layers: int = 8
    """Decoder layers (each one token mixer + one FFN)."""
    rms_norm_eps: float = 1e-5
    """Epsilon of every RMSNorm except MLA's q_a/kv_a norms (those use 1e-6)."""
    tie_word_embeddings: bool = False
    """Share the embedding matrix with the output head (K3 does not)."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of every projection."""

    # Gated MLA (NoPE)
    num_attention_heads: int = 4
    """MLA heads."""
    q_lora_rank: int | None = 64
    """Rank of the query compression `q_a_proj`; null for a full-rank `q_proj`."""
    kv_lora_rank: int = 32
    """Rank of the joint key/value compression."""
    qk_nope_head_dim: int = 32
    """Per-head query/key width without position encoding."""
    qk_rope_head_dim: int = 16
    """Per-head 'rope' slice, kept for checkpoint compatibility; never rotated (NoPE)."""
    v_head_dim: int = 32
    """Per-head value width."""
    mla_use_output_gate: bool = True
    """Per-head sigmoid output gate before `o_proj` (Gated MLA)."""

    linear_attn_config: LinearAttnConfig = field(default_factory=LinearAttnConfig)

    # Feed-forward
    hidden_act: Literal["situ", "silu"] = "situ"
    """GLU activation of the dense MLP and every expert: SiTU-GLU (K3) or SwiGLU (ablation)."""
    activation_situ_beta: float = 4.0
    """SiTU gate soft-cap beta1."""
    activation_situ_linear_beta: float = 25.0
    """SiTU linear-branch soft-cap beta2."""
    intermediate_size: int = 256
    """Dense MLP width (the first `first_k_dense_replace` layers)."""
    first_k_dense_replace: int = 1
    """Number of leading layers with a dense MLP instead of MoE."""

    # Stable LatentMoE
    num_experts: int = 16
    """Routed experts per MoE layer."""
    num_experts_per_token: int = 4
    """Top-k."""
    num_shared_experts: int = 1
    """Full-width shared experts (stored as one MLP of num_shared_experts * moe_intermediate_size)."""
    moe_intermediate_size: int = 64
    """Intermediate width of one expert."""
    routed_expert_hidden_size: int | None = 64
    """Latent width the routed experts live in (`d/2` in K3); null: no latent projections, the
    experts work at `hidden_size` (a plain MoE, as in Kimi Linear; needs `latent_moe_use_norm: false`)."""
    routed_scaling_factor: float = 1.0
    """Multiplier of the renormalised routing weights."""
    moe_renormalize: bool = True
    """Renormalise the chosen experts' scores to sum to one."""
    latent_moe_use_norm: bool = True
    """RMSNorm between the weighted expert sum and `W_up` (the 'Stable' in Stable LatentMoE)."""
    balancer: Literal["quantile", "quantile_histogram", "sign", "none"] = "quantile_histogram"
    """How the routing bias is updated after each step (docs/design.md §1.5)."""
    balancer_bins: int = 1000
    """Histogram bins per expert for `quantile_histogram`."""
    balancer_sign_rate: float = 1e-3
    """Step size of the `sign` balancer."""

    # Attention Residuals
    attn_res: Literal["block", "full", "none"] = "block"
    """Depth mixing: Block AttnRes, Full AttnRes (every sublayer its own source), or plain residuals."""
    attn_res_block_size: int = 2
    """Decoder layers per AttnRes block."""

    # Memory
    recompute: Literal["none", "attn_res", "sublayer"] = "attn_res"
    """Activation checkpointing: none; the AttnRes mixes (K3's default); or whole sublayers."""
    recompute_glu: bool = False
    """SiTU-GLU (dense MLP, shared and routed experts) keeps its gate and up projections' outputs
    for backward, in their own dtype, instead of four fp32 factors, and recomputes the factors
    there (exact; docs/planning.md, "Activation options")."""

    # Kernels
    linear_backend: Literal["auto", "torch", "te"] = "auto"
    """GEMMs of the dense projections and routed experts: `torch` (nn.Linear, grouped_mm),
    `te` (Transformer Engine Linear/GroupedLinear on this rank's shard; needs CUDA and
    transformer-engine), or `auto` (te on CUDA when Transformer Engine imports, else torch).
    Parameter names and shapes are the same under both; docs/precision.md."""

    # ------------------------------------------------------------------ derived
    @property
    def full_attn_layer_set(self) -> frozenset[int]:
        """0-based indices of the Gated MLA layers."""
        one_based = self.linear_attn_config.full_attn_layers
        if one_based is None:
            one_based = [i for i in range(1, self.num_hidden_layers + 1) if i % 4 == 0]
            one_based.append(self.num_hidden_layers)
        return frozenset(i - 1 for i in one_based)

    def is_mla_layer(self, layer_index: int) -> bool:
        return layer_index in self.full_attn_layer_set

    def is_moe_layer(self, layer_index: int) -> bool:
        return layer_index >= self.first_k_dense_replace and self.num_experts > 0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def expert_width(self) -> int:
        """Width the routed experts read and write: the latent width, or `hidden_size` without one."""
        return self.routed_expert_hidden_size if self.routed_expert_hidden_size is not None else self.hidden_size

    @property
    def kda_output_gate_rank(self) -> int | None:
        """Inner width of KDA's low-rank output gate; None for the full-rank `g_proj`."""
        lac = self.linear_attn_config
        if lac.output_gate == "full":
            return None
        return lac.output_gate_rank if lac.output_gate_rank is not None else lac.head_dim

    @property
    def kda_gate_rank(self) -> int:
        lac = self.linear_attn_config
        return lac.gate_low_rank_dim if lac.gate_low_rank_dim is not None else lac.head_dim

    def validate(self) -> None:
        """Raise ValueError naming the first out-of-range or inconsistent field."""
        problem = out_of_range(self, FIELD_RANGES, "model.")
        if problem is None and self.num_experts and not 1 <= self.num_experts_per_token < self.num_experts:
            problem = (
                f"model.num_experts_per_token must lie in [1, model.num_experts) = [1, {self.num_experts}), "
                f"got {self.num_experts_per_token}"
            )
        if problem is not None:
            raise ValueError(problem)
        checks = [
            (self.qk_head_dim >= 1, "qk_nope_head_dim + qk_rope_head_dim must be at least 1"),
            (self.attn_res_block_size >= 1, "attn_res_block_size must be at least 1"),
            (self.hidden_size > 0 and self.num_hidden_layers > 0, "hidden_size and num_hidden_layers must be positive"),
            (
                all(0 <= i < self.num_hidden_layers for i in self.full_attn_layer_set),
                "linear_attn_config.full_attn_layers must be 1-based layer numbers within num_hidden_layers",
            ),
            (
                0 <= self.first_k_dense_replace <= self.num_hidden_layers,
                "first_k_dense_replace must lie in [0, num_hidden_layers]",
            ),
            (
                self.routed_expert_hidden_size is not None or not self.latent_moe_use_norm,
                "latent_moe_use_norm needs a latent width (routed_expert_hidden_size null has no latent)",
            ),
            (
                self.linear_attn_config.output_gate in ("full", "low_rank"),
                "linear_attn_config.output_gate must be 'full' or 'low_rank'",
            ),
            (self.linear_backend in ("auto", "torch", "te"), "linear_backend must be 'auto', 'torch' or 'te'"),
            (
                self.linear_attn_config.gate_lower_bound is None
                or -5.0 <= self.linear_attn_config.gate_lower_bound < 0,
                "linear_attn_config.gate_lower_bound must be in [-5, 0) or null",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"model config: {message}")

    # ------------------------------------------------------------------ presets
    @classmethod
    def preset(cls, name: str) -> ModelConfig:
        if name == "debug":
            return cls()
        if name == "k3":
            return cls(
                vocab_size=163840,
                hidden_size=7168,
                num_hidden_layers=93,
                num_attention_heads=96,
                q_lora_rank=1536,
                kv_lora_rank=512,
                qk_nope_head_dim=128,
                qk_rope_head_dim=64,
                v_head_dim=128,
                linear_attn_config=LinearAttnConfig(num_heads=96, head_dim=128, gate_lower_bound=-5.0),
                intermediate_size=33792,
                first_k_dense_replace=1,
                num_experts=896,
                num_experts_per_token=16,
                num_shared_experts=2,
                moe_intermediate_size=3072,
                routed_expert_hidden_size=3584,
                attn_res_block_size=12,
            )
        raise ValueError(f"unknown model preset {name!r}; choose 'debug' or 'k3'")

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)
