"""A bare Kimi Linear `config.json` as transformers' own `KimiLinearConfig` (transformers 5.23)
reads it: its field names and aliases, its defaults for what `save_pretrained` leaves out, its
layer and MLP patterns. `hf_config.py` turns the result into a k3train `ModelConfig`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from k3train.checkpoint.hf import HFConversionError

# What a bare Kimi Linear config means by a field it does not write: transformers' own
# `KimiLinearConfig` defaults (transformers 5.23), and K3 features it lacks switched off. Its
# `save_pretrained` leaves fields equal to these out, so they are read as transformers reads them.
_KIMI_LINEAR_DEFAULTS: dict[str, Any] = {
    "vocab_size": 163840,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "moe_intermediate_size": 1024,
    "num_hidden_layers": 27,
    "num_attention_heads": 32,
    "num_shared_experts": 1,
    "routed_scaling_factor": 2.446,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "num_expert_group": 1,
    "topk_group": 1,
    "num_experts_per_token": 8,
    "moe_renormalize": True,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "num_experts": 256,
    "linear_head_dim": 128,
    "linear_num_heads": 32,
    "linear_conv_kernel_dim": 4,
    "bos_token_id": 163584,
    "eos_token_id": 163586,
    "pad_token_id": 163839,
    # K3 features transformers' Kimi Linear does not have
    "mla_use_nope": True,
    "mla_use_output_gate": False,
    "latent_moe_use_norm": False,
    "routed_expert_hidden_size": None,
}
# transformers' flat Kimi Linear fields and the linear_attn_config entry each one stands for (the
# entry wins where both are written, as in KimiLinearConfig.__post_init__).
_KIMI_LINEAR_FLAT_FIELDS = (
    ("linear_num_heads", "num_heads"),
    ("linear_head_dim", "head_dim"),
    ("linear_conv_kernel_dim", "short_conv_kernel_size"),
)
# Alternative spellings (transformers' KimiLinearConfig attribute_map and related configs).
_HF_ALIASES = {
    "num_experts_per_tok": "num_experts_per_token",
    "n_shared_experts": "num_shared_experts",
    "norm_topk_prob": "moe_renormalize",
    "num_local_experts": "num_experts",
    "n_routed_experts": "num_experts",
    "n_group": "num_expert_group",
    "model_max_length": "max_position_embeddings",
}


def apply_aliases(text: dict[str, Any]) -> None:
    for key, canonical in _HF_ALIASES.items():
        if key in text and canonical not in text:
            text[canonical] = text[key]


def kimi_linear_text(top: Mapping[str, Any], source: str = "config.json") -> dict[str, Any]:
    """A bare Kimi Linear `config.json` as transformers' `KimiLinearConfig` reads it, in the
    text-config form `_from_hf_config` reads: its aliases (`num_local_experts`, `n_group`, …), its
    defaults for what the file leaves out, its flat `linear_num_heads` / `linear_head_dim` /
    `linear_conv_kernel_dim` (a `linear_attn_config` entry wins), its layer pattern (`layer_types`,
    else `linear_attn_config`'s full/kda lists when both are given, else its default: full
    attention on every 4th layer counted from 0, layer 0 excluded) and its dense-then-MoE pattern
    (`mlp_layer_types`, else `first_k_dense_replace`, default 1)."""
    text = dict(top)
    apply_aliases(text)
    for name, value in _KIMI_LINEAR_DEFAULTS.items():
        text.setdefault(name, value)
    linear = dict(text.get("linear_attn_config") or {})
    for flat, entry in _KIMI_LINEAR_FLAT_FIELDS:
        linear.setdefault(entry, text[flat])
    linear.setdefault("gate_lower_bound", None)
    layers = int(text["num_hidden_layers"])
    if text.get("layer_types") is not None:
        full = full_attention_layers(text["layer_types"], source)
    elif "full_attn_layers" in linear and "kda_layers" in linear:
        full = sorted(int(i) for i in linear["full_attn_layers"])
    else:
        full = [i + 1 for i in range(layers) if i and i % 4 == 0]
    linear["full_attn_layers"] = full
    linear["kda_layers"] = [i for i in range(1, layers + 1) if i not in set(full)]
    text["linear_attn_config"] = linear
    kinds = text.get("mlp_layer_types")
    if kinds:
        text["first_k_dense_replace"] = next((i for i, kind in enumerate(kinds) if kind != "dense"), len(kinds))
    text.setdefault("first_k_dense_replace", 1)
    return text


def full_attention_layers(layer_types: Any, source: str) -> list[int]:
    """1-based full-attention layers of transformers' `layer_types`."""
    kinds = list(layer_types)
    unknown = sorted({str(k) for k in kinds} - {"full_attention", "linear_attention"})
    if unknown:
        raise HFConversionError(
            f"cannot convert {source}: layer_types holds {', '.join(unknown)}: k3train has full_attention (MLA) "
            "and linear_attention (KDA)"
        )
    return [i + 1 for i, kind in enumerate(kinds) if kind == "full_attention"]
