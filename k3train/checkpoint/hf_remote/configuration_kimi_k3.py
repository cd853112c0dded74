"""Kimi K3 configuration for `AutoConfig.from_pretrained(DIR, trust_remote_code=True)`.

Written by k3train's `tools/convert_checkpoint.py to-hf` beside the weights; needs transformers
only (never k3train). The text model's fields live in `text_config` (a `kimi_linear`-typed dict,
with the fields Kimi Linear lacks: AttnRes, SiTU, LatentMoE, bounded KDA gate, gated MLA)."""

from __future__ import annotations

from transformers import PretrainedConfig


class KimiK3TextConfig(PretrainedConfig):
    """The text model's fields as written (k3train's ModelConfig names; `linear_attn_config` and
    `k3train` as nested dicts)."""

    model_type = "kimi_k3_text"


class KimiK3Config(PretrainedConfig):
    model_type = "kimi_k3"
    sub_configs = {"text_config": KimiK3TextConfig}

    def __init__(self, text_config=None, tie_word_embeddings: bool = False, **kwargs):
        if isinstance(text_config, dict) or text_config is None:
            text_config = KimiK3TextConfig(**dict(text_config or {}))
        self.text_config = text_config
        # transformers' @strict(accept_kwargs=True) wraps the dataclass __init__ to take extra kwargs
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)  # type: ignore[call-arg]
