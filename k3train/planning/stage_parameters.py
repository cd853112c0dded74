"""Parameters and optimizer state of one pipeline rank from `model/flops.py`'s closed forms,
without building it: what the layout search prices thousands of layouts with (`tools/plan.py`
builds the chosen layout's ranks exactly on the meta device)."""

from __future__ import annotations

from collections.abc import Sequence

from k3train.model import flops as F
from k3train.model.config import ModelConfig


def stage_parameters(
    cfg: ModelConfig, layer_ranges: Sequence[tuple[int, int]], tp: int, ep: int
) -> tuple[float, float]:
    """(parameters, optimizer state elements) of one pipeline rank, from the closed forms:
    mixers, MLPs and shared experts split over TP, routed experts over EP, embedding and head over
    TP (AdamW: two moments), everything else replicated (Muon: one momentum)."""
    params = state = 0.0
    mla_layers = cfg.full_attn_layer_set  # a property that rebuilds the set: read it once
    for start, end in layer_ranges:
        for layer in range(start, end):
            mixer = F.mla_mixer_parameters(cfg) if layer in mla_layers else F.kda_mixer_parameters(cfg)
            if cfg.is_moe_layer(layer):
                ffn = (
                    F.shared_experts_parameters(cfg) / tp
                    + F.routed_experts_parameters(cfg, cfg.num_experts) / ep
                    + F.latent_projection_parameters(cfg)
                    + F.router_parameters(cfg)
                )
            else:
                ffn = F.glu_mlp_parameters(cfg.hidden_size, cfg.intermediate_size) / tp
            layer_params = mixer / tp + ffn + 6 * cfg.hidden_size
            params += layer_params
            state += layer_params
        ends = (start == 0) + (end == cfg.num_hidden_layers)
        params += ends * cfg.vocab_size * cfg.hidden_size / tp
        state += ends * 2 * cfg.vocab_size * cfg.hidden_size / tp
    return params, state


__all__ = ["stage_parameters"]
