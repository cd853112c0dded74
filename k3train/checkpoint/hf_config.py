"""Kimi K3 Hugging Face hub `config.json` ⇄ k3train `ModelConfig` (docs/hf_conversion.md): the
fields written under their own names, the hub-only constants, the k3train-only fields kept in
`text_config.k3train`, and the refusals of what k3train cannot represent."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from k3train.checkpoint.hf import K3_HUB, KIMI_LINEAR_HUB, HFConversionError, HubLayout
from k3train.checkpoint.hf_kimi_linear_config import apply_aliases, full_attention_layers, kimi_linear_text
from k3train.checkpoint.hf_tokenizer import SpecialTokens
from k3train.model.config import LinearAttnConfig, ModelConfig

HF_MODEL_TYPE = "kimi_k3"
HF_TEXT_MODEL_TYPE = "kimi_linear"
HF_REMOTE_TEXT_MODEL_TYPE = "kimi_k3_text"
"""The text config's model_type once the remote code's `KimiK3TextConfig` has saved it."""
HF_ARCHITECTURES = ["KimiK3ForConditionalGeneration"]
HF_TEXT_ARCHITECTURES = ["KimiLinearForCausalLM"]
DEFAULT_MAX_POSITION_EMBEDDINGS = 1048576
"""The published value. K3 has no position embeddings (KDA carries position, MLA is NoPE), so
this is no architectural limit; HF tooling reads it as the usable context length."""

# ModelConfig fields written under the same name into text_config.
_HF_MODEL_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "intermediate_size",
    "first_k_dense_replace",
    "num_attention_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "mla_use_output_gate",
    "num_experts",
    "num_experts_per_token",
    "num_shared_experts",
    "moe_intermediate_size",
    "routed_expert_hidden_size",
    "latent_moe_use_norm",
    "moe_renormalize",
    "routed_scaling_factor",
    "hidden_act",
    "activation_situ_beta",
    "activation_situ_linear_beta",
    "attn_res",
    "attn_res_block_size",
    "rms_norm_eps",
    "tie_word_embeddings",
)
_HF_LINEAR_ATTN_FIELDS = (
    "num_heads",
    "head_dim",
    "short_conv_kernel_size",
    "gate_lower_bound",
    "gate_low_rank_dim",
    "output_gate_rank",
)
# Fields k3train derives itself (never stored in the k3train sub-dict): the layer pattern from
# full_attn_layers/kda_layers, the output gate's kind from use_full_rank_gate.
_DERIVED_LINEAR_ATTN_FIELDS = ("full_attn_layers", "output_gate")


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
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    max_position_embeddings: int = DEFAULT_MAX_POSITION_EMBEDDINGS,
    allow_k3train_only: bool = False,
    a_log_width: int | None = None,
) -> dict[str, Any]:
    """The hub `config.json` of `config` (no `quantization_config`; docs/hf_conversion.md).

    `a_log_width`: the width `A_log` is written with (`to-hf --pad-a-log`), recorded as
    `linear_attn_config.a_log_shape` so the bundled remote code declares the stored shape.

    Fields with no HF name (attn_res mode, balancer, recompute, init_std, KDA chunk size, …) go
    into `text_config["k3train"]`, so `from_hf_config` restores the exact ModelConfig.

    Every `attn_res` mode exports: the bundled remote code (`hf_remote/modeling_kimi_k3.py`) runs
    Block, Full and plain residuals. `allow_k3train_only` is accepted and no longer needed (it
    once let full/none through when the hub code ran Block AttnRes only).
    """
    config.validate()
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
    text.update(
        {
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
                "use_full_rank_gate": lac.output_gate == "full",
                "gate_lower_bound": lac.gate_lower_bound,
                "gate_low_rank_dim": lac.gate_low_rank_dim,  # null: head_dim
                "output_gate_rank": lac.output_gate_rank,  # null: head_dim
                "kda_layers": kda,
                "full_attn_layers": full,
            },
        }
    )
    if a_log_width is not None and a_log_width != lac.num_heads:
        text["linear_attn_config"]["a_log_shape"] = [int(a_log_width)]
    extras = _k3train_extras(config)
    if config.attn_res != "block":  # the block size means nothing then: kept for the exact round trip only
        extras["attn_res_block_size"] = text.pop("attn_res_block_size")
    # Written even when unknown (null): a missing id means transformers' class default, which
    # for Kimi Linear is an id of its own 163840-token vocabulary.
    for key, value in (("bos_token_id", bos_token_id), ("eos_token_id", eos_token_id), ("pad_token_id", pad_token_id)):
        text[key] = value if value is None or isinstance(value, list) else int(value)
    text["k3train"] = extras

    top: dict[str, Any] = {
        "architectures": list(HF_ARCHITECTURES),
        "model_type": HF_MODEL_TYPE,
        "text_config": text,
        "tie_word_embeddings": config.tie_word_embeddings,
        "torch_dtype": _dtype_name(dtype),
    }
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        top[key] = text[key]
    return top


def hub_layout(hf_config: Mapping[str, Any]) -> HubLayout:
    """The tensor layout a `config.json` describes: K3's (`kimi_k3` with a `text_config`) or a
    bare Kimi Linear causal LM's (`model.…`, `lm_head.weight`)."""
    if hf_config.get("model_type") == HF_MODEL_TYPE or "text_config" in hf_config:
        return K3_HUB
    return KIMI_LINEAR_HUB


def kimi_linear_refusal(config: ModelConfig) -> str | None:
    """Why `config` is not a model transformers' `KimiLinearForCausalLM` computes (the first
    feature it lacks, naming the k3train field), or None when it is."""
    lac = config.linear_attn_config
    checks = [
        (
            config.attn_res == "none",
            f"Attention Residuals (model.attn_res={config.attn_res!r}; Kimi Linear has plain residuals: none)",
        ),
        (
            config.hidden_act == "silu",
            f"the {config.hidden_act!r} GLU (model.hidden_act; Kimi Linear uses SwiGLU: silu)",
        ),
        (
            config.num_experts == 0 or config.routed_expert_hidden_size is None,
            f"LatentMoE projections (model.routed_expert_hidden_size={config.routed_expert_hidden_size}; Kimi Linear's "
            "experts work at hidden width: null)",
        ),
        (not config.latent_moe_use_norm, "the latent MoE RMSNorm (model.latent_moe_use_norm; Kimi Linear: false)"),
        (
            config.num_experts == 0 or config.num_shared_experts >= 1,
            "a routed-only MoE (model.num_shared_experts=0; Kimi Linear has at least 1 shared expert)",
        ),
        (not config.mla_use_output_gate, "the Gated MLA output gate (model.mla_use_output_gate; Kimi Linear: false)"),
        (
            lac.gate_lower_bound is None,
            f"the bounded KDA decay gate (model.linear_attn_config.gate_lower_bound={lac.gate_lower_bound}; Kimi Linear: null)",
        ),
        (
            lac.output_gate == "low_rank",
            "the full-rank KDA output gate (model.linear_attn_config.output_gate=full; "
            "it has the low-rank g_a_proj/g_b_proj gate only: train with "
            "model.linear_attn_config.output_gate=low_rank)",
        ),
        (
            config.kda_output_gate_rank in (None, lac.head_dim),
            f"a KDA output gate rank other than head_dim (model.linear_attn_config.output_gate_rank={lac.output_gate_rank})",
        ),
        (
            config.kda_gate_rank == lac.head_dim,
            f"a KDA decay gate rank other than head_dim (model.linear_attn_config.gate_low_rank_dim={lac.gate_low_rank_dim})",
        ),
        (not config.tie_word_embeddings, "tied embeddings (model.tie_word_embeddings; Kimi Linear's head is untied)"),
    ]
    for ok, feature in checks:
        if not ok:
            return feature
    return None


def to_kimi_linear_config(
    config: ModelConfig,
    *,
    dtype: torch.dtype = torch.bfloat16,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    max_position_embeddings: int = DEFAULT_MAX_POSITION_EMBEDDINGS,
) -> dict[str, Any]:
    """The `config.json` of a `KimiLinearForCausalLM` computing `config` (transformers' own
    `kimi_linear`, no remote code). Raises `HFConversionError` naming the first feature Kimi Linear
    lacks (`kimi_linear_refusal`). k3train-only fields (balancer, recompute, init_std, KDA chunk
    size, …) ride along in `k3train`, which transformers ignores, so from-hf restores them."""
    config.validate()
    refusal = kimi_linear_refusal(config)
    if refusal is not None:
        raise HFConversionError(
            f"cannot export as Kimi Linear: transformers' KimiLinearForCausalLM lacks {refusal}; "
            "--format kimi_k3 exports every K3 feature (with remote code)"
        )
    # transformers sizes the embedding's padding_idx from pad_token_id: an id outside the
    # vocabulary (a tokenizer's id the padded vocabulary does not hold) fails to load: null.
    ids = {
        key: (value if value is not None and 0 <= value < config.vocab_size else None)
        for key, value in (
            ("bos_token_id", bos_token_id),
            ("eos_token_id", eos_token_id),
            ("pad_token_id", pad_token_id),
        )
    }
    k3 = to_hf_config(
        config, dtype=dtype, max_position_embeddings=max_position_embeddings, allow_k3train_only=True, **ids
    )["text_config"]
    text = {
        key: value
        for key, value in k3.items()
        if key
        not in (
            "mla_use_output_gate",
            "routed_expert_hidden_size",
            "latent_moe_use_norm",
            "activation_situ_beta",
            "activation_situ_linear_beta",
            "attn_res",
            "attn_res_block_size",
        )
    }
    text["linear_attn_config"] = {
        key: value for key, value in k3["linear_attn_config"].items() if key not in ("gate_lower_bound",)
    }
    if config.num_experts == 0:  # transformers builds MoE after first_k_dense_replace whenever it is below the depth
        text["first_k_dense_replace"] = config.num_hidden_layers
    text["tie_word_embeddings"] = False
    extras = dict(text.pop("k3train"))
    extras.pop("attn_res_block_size", None)  # a K3-export entry; written below from the config
    for name in (
        "mla_use_output_gate",
        "routed_expert_hidden_size",
        "latent_moe_use_norm",
        "activation_situ_beta",
        "activation_situ_linear_beta",
        "attn_res",
        "attn_res_block_size",
        "first_k_dense_replace",
    ):
        extras[name] = getattr(config, name)
    extras.setdefault("linear_attn_config", {})["gate_lower_bound"] = None
    text["k3train"] = extras
    return text


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
    """The ModelConfig of a hub `config.json`: a `kimi_k3` config with `text_config` (written by
    to-hf, or saved again by the remote code, text model_type `kimi_k3_text`), or a bare
    `kimi_linear` config read as transformers' `KimiLinearConfig` reads it (`kimi_linear_text`).

    Raises `HFConversionError` (one line) for what k3train cannot represent: rotary MLA
    (`mla_use_nope` false), grouped top-k that keeps only some groups, a `quantization_config`,
    another router activation, MoE on a layer pattern other than `moe_layer_freq: 1`,
    multi-token-prediction layers, attention biases.
    """
    top = dict(hf_config)
    bare_kimi_linear = hub_layout(top) is KIMI_LINEAR_HUB
    if bare_kimi_linear:
        model_type = top.get("model_type")
        if model_type not in (HF_TEXT_MODEL_TYPE, None):
            raise _refuse(source, f"model_type {model_type!r} is neither {HF_MODEL_TYPE!r} nor {HF_TEXT_MODEL_TYPE!r}")
        text = kimi_linear_text(top, source)
    else:
        text = dict(top.get("text_config") or {})
        model_type = text.get("model_type")
        if model_type not in (HF_TEXT_MODEL_TYPE, HF_REMOTE_TEXT_MODEL_TYPE, None):
            raise _refuse(
                source,
                f"text model_type {model_type!r} is neither {HF_TEXT_MODEL_TYPE!r} nor {HF_REMOTE_TEXT_MODEL_TYPE!r}",
            )
        apply_aliases(text)
    if "routed_expert_hidden_size" not in text:  # no latent width: a plain MoE
        text["routed_expert_hidden_size"] = None
        text.setdefault("latent_moe_use_norm", False)
    _refuse_unrepresentable(top, text, source)
    linear = dict(text.get("linear_attn_config") or {})
    # Kimi Linear's low-rank output gate unless the config says full rank (K3 writes true).
    full_rank_gate = linear.get("use_full_rank_gate", not bare_kimi_linear)
    _check_layer_types(text, source)

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
    if full is None and kda is None and text.get("layer_types"):
        full = full_attention_layers(text["layer_types"], source)
    if full is None and kda is not None:
        full = [i for i in range(1, num_layers + 1) if i not in set(kda)]
    if full is not None:
        full = sorted(int(i) for i in full)
        kda_set = set(int(i) for i in kda) if kda is not None else set(range(1, num_layers + 1)) - set(full)
        if set(full) & kda_set or set(full) | kda_set != set(range(1, num_layers + 1)):
            raise _refuse(
                source,
                f"linear_attn_config.kda_layers and full_attn_layers do not split layers 1..{num_layers} between them",
            )
        lac_values["full_attn_layers"] = None if full == default_full_attn_layers(num_layers) else full
    lac_values["output_gate"] = "full" if full_rank_gate else "low_rank"
    lac_values.update(extras.pop("linear_attn_config", None) or {})
    values["linear_attn_config"] = LinearAttnConfig(**_known(LinearAttnConfig, lac_values, source))

    if "attn_res" not in text and "attn_res_block_size" not in text and "attn_res" not in extras:
        values["attn_res"] = "none"  # no AttnRes in the checkpoint (e.g. a plain Kimi Linear)
    values.update(extras)  # k3train's own record of its config wins (a Kimi Linear export keeps K3 fields here)
    config = ModelConfig(**_known(ModelConfig, values, source))
    try:
        config.validate()
    except ValueError as error:
        raise _refuse(source, str(error)) from None
    return config


def _refuse_unrepresentable(top: Mapping[str, Any], text: Mapping[str, Any], source: str) -> None:
    """One line for the first config feature k3train has no model for."""
    quant = top.get("quantization_config") or text.get("quantization_config")
    if quant:
        what = (
            "/".join(str(quant.get(k)) for k in ("quant_method", "format") if quant.get(k))
            if isinstance(quant, Mapping)
            else quant
        )
        raise _refuse(
            source,
            f"quantised checkpoint (quantization_config {what}): k3train loads unquantised "
            "weights only; dequantise the experts to BF16 first",
        )
    if not text.get("mla_use_nope", False):
        raise _refuse(
            source, "rotary MLA (text_config.mla_use_nope is not true): k3train implements NoPE Gated MLA only"
        )
    groups, topk_groups = int(text.get("num_expert_group", 1) or 1), int(text.get("topk_group", 1) or 1)
    # Grouped top-k that keeps every group masks no expert: the same choice as ungrouped routing.
    if text.get("use_grouped_topk", True) and groups > 1 and topk_groups != groups:
        raise _refuse(
            source,
            f"grouped top-k routing keeping {topk_groups} of {groups} expert groups (num_expert_group={groups}, "
            f"topk_group={topk_groups}): k3train routes over all experts, which equals grouped routing only "
            "when topk_group equals num_expert_group",
        )
    activation = text.get("moe_router_activation_func", "sigmoid")
    if activation != "sigmoid":
        raise _refuse(source, f"router activation {activation!r}: k3train implements the sigmoid router only")
    if int(text.get("moe_layer_freq", 1)) != 1:
        raise _refuse(
            source,
            f"moe_layer_freq={text['moe_layer_freq']}: k3train puts MoE on every layer after first_k_dense_replace",
        )
    if int(text.get("num_nextn_predict_layers", 0) or 0) > 0:
        raise _refuse(
            source, f"{text['num_nextn_predict_layers']} multi-token-prediction layers: k3train has no MTP layers"
        )
    if text.get("attention_bias"):
        raise _refuse(source, "attention_bias is true: k3train's attention projections have no biases")
    hidden_act = text.get("hidden_act", "situ")
    if hidden_act not in ("situ", "silu"):
        raise _refuse(source, f"hidden_act {hidden_act!r}: k3train implements 'situ' and 'silu' GLUs")
    attn_res = text.get("attn_res")
    if attn_res is not None and attn_res not in ("block", "full", "none"):
        raise _refuse(source, f"attn_res {attn_res!r}: k3train implements 'block', 'full' and 'none'")


def _check_layer_types(text: Mapping[str, Any], source: str) -> None:
    """Refuse transformers' `mlp_layer_types` when they differ from k3train's dense-then-MoE pattern."""
    kinds = text.get("mlp_layer_types")
    if not kinds:
        return
    first_dense = int(text.get("first_k_dense_replace", 1))
    has_experts = int(text.get("num_experts", 0) or 0) > 0
    expected = ["sparse" if has_experts and i >= first_dense else "dense" for i in range(len(kinds))]
    if list(kinds) != expected:
        raise _refuse(
            source,
            f"mlp_layer_types {list(kinds)}: k3train puts a dense MLP on the first "
            "first_k_dense_replace layers and MoE on every later one",
        )


def _known(cls: type, values: dict[str, Any], source: str) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        warnings.warn(
            f"{source}: ignoring k3train fields this version does not know: {', '.join(unknown)}", stacklevel=3
        )
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


def declared_special_tokens(hf_config: Mapping[str, Any], source: str = "config.json") -> SpecialTokens:
    """The bos/eos/pad ids a `config.json` declares, as transformers reads them (a bare Kimi
    Linear config without them means KimiLinearConfig's defaults), kept only where the model's
    vocabulary holds them."""
    text: Mapping[str, Any]
    if hub_layout(hf_config) is KIMI_LINEAR_HUB:
        text = kimi_linear_text(hf_config, source)
        values: Mapping[str, Any] = text
    else:
        nested = hf_config.get("text_config")
        text = nested if isinstance(nested, Mapping) else {}
        values = {key: hf_config.get(key, text.get(key)) for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
    ids = SpecialTokens.from_mapping(values, source)
    vocab = text.get("vocab_size")
    return ids.within(vocab) if isinstance(vocab, int) and not isinstance(vocab, bool) else ids


def with_special_tokens(hf_config: dict[str, Any], ids: SpecialTokens, vocab_size: int) -> dict[str, Any]:
    """`hf_config` with `ids` (those the vocabulary holds; the rest null) at the top and, for the
    K3 layout, in `text_config`."""
    kept = ids.within(vocab_size).as_dict()
    out = dict(hf_config, **kept)
    if "text_config" in out:
        out["text_config"] = dict(out["text_config"], **kept)
    return out
