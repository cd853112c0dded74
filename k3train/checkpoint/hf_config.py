"""Kimi K3 Hugging Face hub `config.json` ⇄ k3train `ModelConfig` (docs/hf_conversion.md): the
fields written under their own names, the hub-only constants, the k3train-only fields kept in
`text_config.k3train`, and the refusals of what k3train cannot represent."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Mapping, Optional

import torch

from k3train.checkpoint.hf import HFConversionError
from k3train.model.config import LinearAttnConfig, ModelConfig

HF_MODEL_TYPE = "kimi_k3"
HF_TEXT_MODEL_TYPE = "kimi_linear"
HF_ARCHITECTURES = ["KimiK3ForConditionalGeneration"]
HF_TEXT_ARCHITECTURES = ["KimiLinearForCausalLM"]
DEFAULT_MAX_POSITION_EMBEDDINGS = 1048576
"""The published value. K3 has no position embeddings (KDA carries position, MLA is NoPE), so
this is no architectural limit; HF tooling reads it as the usable context length."""

# ModelConfig fields written under the same name into text_config.
_HF_MODEL_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size", "first_k_dense_replace",
    "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
    "v_head_dim", "mla_use_output_gate", "num_experts", "num_experts_per_token", "num_shared_experts",
    "moe_intermediate_size", "routed_expert_hidden_size", "latent_moe_use_norm", "moe_renormalize",
    "routed_scaling_factor", "hidden_act", "activation_situ_beta", "activation_situ_linear_beta",
    "attn_res_block_size", "rms_norm_eps", "tie_word_embeddings",
)
_HF_LINEAR_ATTN_FIELDS = ("num_heads", "head_dim", "short_conv_kernel_size", "gate_lower_bound")
# Fields k3train derives itself (never stored in the k3train sub-dict).
_DERIVED_LINEAR_ATTN_FIELDS = ("full_attn_layers",)
# Alternative spellings some configs use (transformers' KimiLinearConfig attribute_map).
_HF_ALIASES = {
    "num_experts_per_tok": "num_experts_per_token",
    "n_shared_experts": "num_shared_experts",
    "norm_topk_prob": "moe_renormalize",
    "num_local_experts": "num_experts",
    "n_routed_experts": "num_experts",
    "n_group": "num_expert_group",
}


def default_full_attn_layers(num_hidden_layers: int) -> list[int]:
    """K3's pattern, 1-based: every 4th layer and the last one (ModelConfig's null)."""
    layers = [i for i in range(1, num_hidden_layers + 1) if i % 4 == 0]
    if num_hidden_layers not in layers:
        layers.append(num_hidden_layers)
    return layers


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def to_hf_config(
    config: ModelConfig,
    *,
    dtype: torch.dtype = torch.bfloat16,
    bos_token_id: Optional[int] = None,
    eos_token_id: Optional[int] = None,
    pad_token_id: Optional[int] = None,
    max_position_embeddings: int = DEFAULT_MAX_POSITION_EMBEDDINGS,
    allow_k3train_only: bool = False,
) -> dict[str, Any]:
    """The hub `config.json` of `config` (no `quantization_config`; docs/hf_conversion.md).

    Fields with no HF name (attn_res mode, balancer, recompute, init_std, KDA chunk size, …) go
    into `text_config["k3train"]`, so `from_hf_config` restores the exact ModelConfig.

    The HF modelling code implements Block AttnRes only: `attn_res: full` or `none` raises
    `HFConversionError` unless `allow_k3train_only` (the directory then loads in k3train, through
    `from_hf_config`/`tools/score.py`/`from-hf`, but not in Hugging Face's K3 code).
    """
    config.validate()
    if config.attn_res != "block" and not allow_k3train_only:
        raise HFConversionError(
            f"model.attn_res={config.attn_res!r} cannot be exported: the Hugging Face Kimi K3 modelling "
            "code implements only Block AttnRes (attn_res_block_size); pass --allow-k3train-only to "
            "write a directory that k3train (tools/score.py, from-hf) reads but HF's K3 code cannot run"
        )
    lac = config.linear_attn_config
    num_layers = config.num_hidden_layers
    full = sorted(i + 1 for i in config.full_attn_layer_set)
    kda = [i for i in range(1, num_layers + 1) if i not in set(full)]

    text: dict[str, Any] = {
        "model_type": HF_TEXT_MODEL_TYPE,
        "architectures": list(HF_TEXT_ARCHITECTURES),
    }
    for name in _HF_MODEL_FIELDS:
        text[name] = getattr(config, name)
    text.update({
        "moe_layer_freq": 1,
        "num_key_value_heads": config.num_attention_heads,
        "mla_use_nope": True,
        "moe_router_activation_func": "sigmoid",
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "max_position_embeddings": int(max_position_embeddings),
        "num_nextn_predict_layers": 0,
        "torch_dtype": _dtype_name(dtype),
        "linear_attn_config": {
            "num_heads": lac.num_heads,
            "head_dim": lac.head_dim,
            "short_conv_kernel_size": lac.short_conv_kernel_size,
            "use_full_rank_gate": True,
            "gate_lower_bound": lac.gate_lower_bound,
            "kda_layers": kda,
            "full_attn_layers": full,
        },
    })
    if config.attn_res == "none":
        text.pop("attn_res_block_size")
    for key, value in (("bos_token_id", bos_token_id), ("eos_token_id", eos_token_id), ("pad_token_id", pad_token_id)):
        if value is not None:
            text[key] = int(value)
    text["k3train"] = _k3train_extras(config)

    top: dict[str, Any] = {
        "architectures": list(HF_ARCHITECTURES),
        "model_type": HF_MODEL_TYPE,
        "text_config": text,
        "tie_word_embeddings": config.tie_word_embeddings,
        "torch_dtype": _dtype_name(dtype),
    }
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if key in text:
            top[key] = text[key]
    return top


def _k3train_extras(config: ModelConfig) -> dict[str, Any]:
    """ModelConfig fields with no HF name (every field not written under its own name)."""
    extras: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        if f.name in _HF_MODEL_FIELDS or f.name == "linear_attn_config":
            continue
        extras[f.name] = getattr(config, f.name)
    lac_extras = {
        f.name: getattr(config.linear_attn_config, f.name)
        for f in dataclasses.fields(config.linear_attn_config)
        if f.name not in _HF_LINEAR_ATTN_FIELDS and f.name not in _DERIVED_LINEAR_ATTN_FIELDS
    }
    if lac_extras:
        extras["linear_attn_config"] = lac_extras
    return extras


def _refuse(source: str, what: str) -> HFConversionError:
    return HFConversionError(f"cannot convert {source}: {what}")


def from_hf_config(hf_config: Mapping[str, Any], source: str = "config.json") -> ModelConfig:
    """`_from_hf_config`, with a value of the wrong kind (a string where a number belongs, a list
    where an object belongs) refused in one line instead of a traceback."""
    if not isinstance(hf_config, Mapping):
        raise _refuse(source, f"config.json must hold a JSON object, not a {type(hf_config).__name__}")
    try:
        return _from_hf_config(hf_config, source)
    except HFConversionError:
        raise
    except (ValueError, TypeError, AttributeError, KeyError) as error:
        raise _refuse(source, f"a field has a value of the wrong kind ({type(error).__name__}: {error})") from None


def _from_hf_config(hf_config: Mapping[str, Any], source: str) -> ModelConfig:
    """The ModelConfig of a hub `config.json` (a `kimi_k3` config with `text_config`, or a bare
    `kimi_linear` text config).

    Raises `HFConversionError` (one line) for what k3train cannot represent: rotary MLA
    (`mla_use_nope` false), grouped top-k with more than one group, a `quantization_config`, a
    low-rank KDA output gate, another router activation, MoE on a layer pattern other than
    `moe_layer_freq: 1`, a non-latent MoE, multi-token-prediction layers.
    """
    top = dict(hf_config)
    if top.get("model_type") == HF_MODEL_TYPE or "text_config" in top:
        text = dict(top.get("text_config") or {})
    else:
        text = top
    model_type = text.get("model_type")
    if model_type not in (HF_TEXT_MODEL_TYPE, None):
        raise _refuse(source, f"text model_type {model_type!r} is not {HF_TEXT_MODEL_TYPE!r} (Kimi Linear / K3)")
    for key, canonical in _HF_ALIASES.items():
        if key in text and canonical not in text:
            text[canonical] = text[key]
    quant = top.get("quantization_config") or text.get("quantization_config")
    if quant:
        what = "/".join(str(quant.get(k)) for k in ("quant_method", "format") if quant.get(k)) if isinstance(quant, Mapping) else quant
        raise _refuse(source, f"quantised checkpoint (quantization_config {what}): k3train loads unquantised "
                              "weights only; dequantise the experts to BF16 first")
    if not text.get("mla_use_nope", False):
        raise _refuse(source, "rotary MLA (text_config.mla_use_nope is not true): k3train implements NoPE "
                              "Gated MLA only")
    groups, topk_groups = int(text.get("num_expert_group", 1) or 1), int(text.get("topk_group", 1) or 1)
    if groups > 1 or topk_groups > 1:
        raise _refuse(source, f"grouped top-k routing (num_expert_group={groups}, topk_group={topk_groups}): "
                              "k3train routes with a single group")
    activation = text.get("moe_router_activation_func", "sigmoid")
    if activation != "sigmoid":
        raise _refuse(source, f"router activation {activation!r}: k3train implements the sigmoid router only")
    if int(text.get("moe_layer_freq", 1)) != 1:
        raise _refuse(source, f"moe_layer_freq={text['moe_layer_freq']}: k3train puts MoE on every layer "
                              "after first_k_dense_replace")
    if int(text.get("num_nextn_predict_layers", 0) or 0) > 0:
        raise _refuse(source, f"{text['num_nextn_predict_layers']} multi-token-prediction layers: k3train has "
                              "no MTP layers")
    hidden_act = text.get("hidden_act", "situ")
    if hidden_act not in ("situ", "silu"):
        raise _refuse(source, f"hidden_act {hidden_act!r}: k3train implements 'situ' and 'silu' GLUs")
    linear = dict(text.get("linear_attn_config") or {})
    if linear and not linear.get("use_full_rank_gate", True):
        raise _refuse(source, "low-rank KDA output gate (linear_attn_config.use_full_rank_gate false, "
                              "g_a_proj/g_b_proj): k3train implements K3's full-rank g_proj only")
    num_experts = int(text.get("num_experts", 0) or 0)
    if num_experts > 0 and text.get("routed_expert_hidden_size") is None:
        raise _refuse(source, "MoE without routed_expert_hidden_size (not a LatentMoE): k3train implements "
                              "Stable LatentMoE only")

    defaults = ModelConfig()
    values: dict[str, Any] = {}
    for name in _HF_MODEL_FIELDS:
        if name in text:
            values[name] = text[name]
    values.setdefault("tie_word_embeddings", top.get("tie_word_embeddings", defaults.tie_word_embeddings))
    num_layers = int(values.get("num_hidden_layers", defaults.num_hidden_layers))
    extras = dict(text.get("k3train") or {})

    lac_values: dict[str, Any] = {}
    for name in _HF_LINEAR_ATTN_FIELDS:
        if name in linear:
            lac_values[name] = linear[name]
    full = linear.get("full_attn_layers")
    kda = linear.get("kda_layers")
    if full is None and kda is not None:
        full = [i for i in range(1, num_layers + 1) if i not in set(kda)]
    if full is not None:
        full = sorted(int(i) for i in full)
        kda_set = set(int(i) for i in kda) if kda is not None else set(range(1, num_layers + 1)) - set(full)
        if set(full) & kda_set or set(full) | kda_set != set(range(1, num_layers + 1)):
            raise _refuse(source, "linear_attn_config.kda_layers and full_attn_layers do not split layers "
                                  f"1..{num_layers} between them")
        lac_values["full_attn_layers"] = None if full == default_full_attn_layers(num_layers) else full
    lac_values.update(extras.pop("linear_attn_config", None) or {})
    values["linear_attn_config"] = LinearAttnConfig(**_known(LinearAttnConfig, lac_values, source))

    if "attn_res_block_size" not in text and "attn_res" not in extras:
        values["attn_res"] = "none"  # no AttnRes in the checkpoint (e.g. a plain Kimi Linear)
    for name, value in extras.items():
        if name not in _HF_MODEL_FIELDS:
            values[name] = value
    config = ModelConfig(**_known(ModelConfig, values, source))
    try:
        config.validate()
    except ValueError as error:
        raise _refuse(source, str(error)) from None
    return config


def _known(cls: type, values: dict[str, Any], source: str) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        warnings.warn(f"{source}: ignoring k3train fields this version does not know: {', '.join(unknown)}", stacklevel=3)
    known = {k: v for k, v in values.items() if k in names}
    defaults = cls()
    for name, value in known.items():
        _check_kind(source, name, getattr(defaults, name), value)
    return known


def _check_kind(source: str, name: str, default: Any, value: Any) -> None:
    """Refuse a value whose kind differs from the field's default (bool, int, float, str); None is
    left to the config's own validation (some fields are optional)."""
    if value is None:
        return
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif isinstance(default, str):
        ok = isinstance(value, str)
    else:
        return
    if not ok:
        raise _refuse(source, f"{name} must be {type(default).__name__}, got {value!r}")


def special_token_ids(tokenizer: str) -> dict[str, int]:
    """bos/eos/pad ids of a k3train `data.tokenizer` value, as far as they are known."""
    if tokenizer == "byte":
        from k3train.data.tokenizers import ByteTokenizer

        return {"bos_token_id": ByteTokenizer.bos_id, "eos_token_id": ByteTokenizer.eos_id,
                "pad_token_id": ByteTokenizer.pad_id}
    try:
        from k3train.data.tokenizers import build_tokenizer

        return {"eos_token_id": int(build_tokenizer(tokenizer).eos_id)}
    except Exception:  # a tokenizer that cannot be read here: leave the ids out
        return {}
