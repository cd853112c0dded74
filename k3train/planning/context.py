"""Context parallelism in the planner: the bytes the cp exchanges send per step, per rank.

The exchanges of `parallel/context.py`, in comm.py's convention (an all-gather counts this
rank's contribution, a reduce-scatter its full input, i.e. cp times the contribution), per
micro-batch and layer:

- KDA layer: the short convolutions' tails `[2, b, kernel − 1, 3 · H/tp · K]` (activation
  dtype) all-gathered, backward their reduce-scatter; the states: under "handoff" (the default)
  one `[b, H/tp, K, V]` state (fp32, float64 for float64 models) per piece boundary this rank
  sends across, forward and backward (cp rank 0 and cp − 1 send one each way, the others two);
  under "gather" the two local pieces' affine maps `[2, b, H/tp, K, K + V]` all-gathered,
  backward their reduce-scatter;
- MLA layer: the all-gather of the local compressed KV `[b, s/cp, kv_lora_rank + rope]`
  (activation dtype); backward, its reduce-scatter.

`tests/distributed/test_context_parallel.py` checks the formula against the counted traffic.
"""

from __future__ import annotations

from k3train.model.config import ModelConfig


def context_step_bytes(
    cfg: ModelConfig,
    layers: list[int],
    *,
    cp: int,
    tp: int,
    micro_batch_size: int,
    seq_length: int,
    micro_batches: int,
    element_bytes: int,
    state_bytes: int = 4,
    state_exchange: str = "handoff",
    cp_rank: int | None = None,
) -> float:
    """Bytes one rank sends over its cp group in one training step (0 when cp = 1).

    `layers`: the decoder layers of this rank's stage; `element_bytes`: the activations' element
    size (2 under bf16 autocast); `state_bytes`: the KDA states' (4, or 8 for float64 models);
    `cp_rank`: which rank (None: the busiest)."""
    if cp == 1:
        return 0.0
    lac = cfg.linear_attn_config
    heads, key_dim = lac.num_heads // tp, lac.head_dim
    tails = 2 * micro_batch_size * (lac.short_conv_kernel_size - 1) * 3 * heads * key_dim * element_bytes
    if state_exchange == "gather":
        maps = (1 + cp) * 2 * micro_batch_size * heads * key_dim * (key_dim + key_dim) * state_bytes
    else:
        boundaries = (
            min(2, cp - 1) if cp_rank is None else int(cp_rank < cp - 1) + int(cp_rank > 0)
        )  # neighbours this rank sends to
        maps = 2 * boundaries * micro_batch_size * heads * key_dim * key_dim * state_bytes
    tails *= 1 + cp
    latent = micro_batch_size * (seq_length // cp) * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * element_bytes
    per_micro_batch = sum((1 + cp) * latent if cfg.is_mla_layer(layer) else maps + tails for layer in layers)
    return float(micro_batches * per_micro_batch)


def context_extra_activation_bytes(
    cfg: ModelConfig, layers: list[int], *, cp: int, tp: int, micro_batch_size: int, seq_length: int, element_bytes: int
) -> float:
    """Activations a rank keeps for backward beyond its own tokens: in every MLA layer, the
    other ranks' tokens' key side (the gathered latent and its norm, `kv_b`'s output, the keys
    and values of this rank's heads), `(cp − 1)/cp` of the sequence. KDA keeps nothing extra
    worth counting (a few maps and tails per piece)."""
    if cp == 1:
        return 0.0
    heads = cfg.num_attention_heads // tp
    per_token = 2 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + heads * (
        2 * (cfg.qk_nope_head_dim + cfg.v_head_dim) + cfg.qk_head_dim
    )
    other_tokens = micro_batch_size * (seq_length - seq_length // cp)
    return float(sum(cfg.is_mla_layer(layer) for layer in layers) * other_tokens * per_token * element_bytes)


__all__ = ["context_extra_activation_bytes", "context_step_bytes"]
