"""Kimi K3 configuration for `AutoConfig.from_pretrained(DIR, trust_remote_code=True)`.

Written by k3train's `tools/convert_checkpoint.py to-hf` beside the weights; needs transformers
only (never k3train). The text model's fields live in `text_config` (a `kimi_linear`-typed dict,
with the fields Kimi Linear lacks: AttnRes, SiTU, LatentMoE, bounded KDA gate, gated MLA)."""

from __future__ import annotations

from transformers import PretrainedConfig

ATTN_RES_MODES = ("block", "full", "none")


class KimiK3TextConfig(PretrainedConfig):
    """The text model's fields as written (k3train's ModelConfig names; `linear_attn_config` and
    `k3train` as nested dicts).

    `attn_res`: the residual stream's form, "block" (Attention Residuals over blocks of
    `attn_res_block_size` layers), "full" (over every sublayer's output) or "none" (plain
    residuals). A config written before the field existed means "block" when it gives
    `attn_res_block_size` and "none" otherwise (unless its `k3train` entry names the mode)."""

    model_type = "kimi_k3_text"

    def __init__(self, attn_res: str | None = None, **kwargs):
        if attn_res is None:
            private = kwargs.get("k3train") or {}
            attn_res = private.get("attn_res") or ("block" if "attn_res_block_size" in kwargs else "none")
        if attn_res not in ATTN_RES_MODES:
            raise ValueError(f"attn_res must be one of {', '.join(ATTN_RES_MODES)}, got {attn_res!r}")
        self.attn_res = attn_res
        # transformers' @strict(accept_kwargs=True) wraps the dataclass __init__ to take extra kwargs
        super().__init__(**kwargs)


class KimiK3Config(PretrainedConfig):
    model_type = "kimi_k3"
    sub_configs = {"text_config": KimiK3TextConfig}

    def __init__(self, text_config=None, tie_word_embeddings: bool = False, **kwargs):
        if isinstance(text_config, dict) or text_config is None:
            text_config = KimiK3TextConfig(**dict(text_config or {}))
        self.text_config = text_config
        # transformers' @strict(accept_kwargs=True) wraps the dataclass __init__ to take extra kwargs
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)  # type: ignore[call-arg]
