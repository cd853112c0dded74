"""Kimi K3 configuration for `AutoConfig.from_pretrained(DIR, trust_remote_code=True)`.

Written by k3train's `tools/convert_checkpoint.py to-hf` beside the weights; needs transformers
only (never k3train). The text model's fields live in `text_config` (a `kimi_linear`-typed dict,
with the fields Kimi Linear lacks: AttnRes, SiTU, LatentMoE, bounded KDA gate, gated MLA)."""

from __future__ import annotations

from transformers import PretrainedConfig

KDA_CONV_STREAMS = 3
"""KDA's short convolutions (q, k, v): one conv state each in a layer's cache."""
KDA_LAYER_TYPE = "kimi_delta_attention"
"""A KDA layer's cache kind (`cache_kimi_k3.KimiDeltaCacheLayer`, registered by the model code)."""
ATTN_RES_MODES = ("block", "full", "none")


class KimiK3TextConfig(PretrainedConfig):
    """The text model's fields as written (k3train's ModelConfig names; `linear_attn_config` and
    `k3train` as nested dicts).

    `attn_res`: the residual stream's form, "block" (Attention Residuals over blocks of
    `attn_res_block_size` layers), "full" (over every sublayer's output) or "none" (plain
    residuals). A config written before the field existed means "block" when it gives
    `attn_res_block_size` and "none" otherwise (unless its `k3train` entry names the mode)."""

    model_type = "kimi_k3_text"

    attn_res: str | None = None

    def __post_init__(self, **kwargs):
        # A dataclass field and a post-init, not an __init__: transformers' config __init__ would
        # validate `layer_types` against its own layer kinds, which know no KDA layer.
        super().__post_init__(**kwargs)
        if self.attn_res is None:
            private = getattr(self, "k3train", None) or {}
            block = getattr(self, "attn_res_block_size", None) is not None
            self.attn_res = private.get("attn_res") or ("block" if block else "none")
        if self.attn_res not in ATTN_RES_MODES:
            raise ValueError(f"attn_res must be one of {', '.join(ATTN_RES_MODES)}, got {self.attn_res!r}")

    @property
    def layer_types(self) -> list[str]:
        """Each layer's cache kind for transformers' `DynamicCache(config=…)`: `full_attention`
        (MLA keys and values) or `kimi_delta_attention` (KDA's recurrent state and conv tails). Derived
        from `linear_attn_config.full_attn_layers` (1-based), never stored."""
        linear = dict(getattr(self, "linear_attn_config", None) or {})
        linear.update(dict(getattr(self, "k3train", None) or {}).get("linear_attn_config") or {})
        full = set(linear.get("full_attn_layers") or [])
        return ["full_attention" if i + 1 in full else KDA_LAYER_TYPE for i in range(self.num_hidden_layers)]

    @property
    def number_of_conv_states(self) -> int:
        return KDA_CONV_STREAMS


class KimiK3Config(PretrainedConfig):
    model_type = "kimi_k3"
    sub_configs = {"text_config": KimiK3TextConfig}

    def __init__(self, text_config=None, tie_word_embeddings: bool = False, **kwargs):
        if isinstance(text_config, dict) or text_config is None:
            text_config = KimiK3TextConfig(**dict(text_config or {}))
        self.text_config = text_config
        # transformers' @strict(accept_kwargs=True) wraps the dataclass __init__ to take extra kwargs
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)  # type: ignore[call-arg]
