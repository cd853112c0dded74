"""The model options Kimi Linear checkpoints need: KDA's low-rank output gate
(`linear_attn_config.output_gate: low_rank`) and a plain MoE without latent projections
(`routed_expert_hidden_size: null`); their parameters, counts and config checks."""

from __future__ import annotations

import pytest
import torch

from k3train.model.config import LinearAttnConfig, ModelConfig
from k3train.model.flops import parameter_counts
from k3train.model.k3 import K3ModelChunk


def _config(**changes) -> ModelConfig:
    lac = LinearAttnConfig(num_heads=4, head_dim=16, output_gate="low_rank", output_gate_rank=8)
    return ModelConfig(
        hidden_size=64,
        num_hidden_layers=4,
        linear_attn_config=lac,
        routed_expert_hidden_size=None,
        latent_moe_use_norm=False,
    ).replace(**changes)


def test_low_rank_output_gate_and_plain_moe_parameters():
    config = _config()
    shapes = {name: tuple(t.shape) for name, t in K3ModelChunk(config).state_dict().items()}
    assert shapes["layers.0.self_attn.g_a_proj.weight"] == (8, 64)
    assert shapes["layers.0.self_attn.g_b_proj.weight"] == (64, 8)
    assert "layers.0.self_attn.g_proj.weight" not in shapes
    assert not [name for name in shapes if "routed_expert" in name]
    assert shapes["layers.1.block_sparse_moe.experts.w1"] == (config.num_experts, config.moe_intermediate_size, 64)
    assert parameter_counts(config).total == sum(p.numel() for p in K3ModelChunk(config).parameters())


def test_output_gate_rank_defaults_to_head_dim_and_full_rank_has_none():
    assert _config(linear_attn_config=LinearAttnConfig(head_dim=16, output_gate="low_rank")).kda_output_gate_rank == 16
    assert ModelConfig().kda_output_gate_rank is None
    assert ModelConfig().expert_width == ModelConfig().routed_expert_hidden_size
    assert _config().expert_width == 64


def test_plain_moe_trains_and_a_latent_norm_without_latent_width_is_refused():
    config = _config()
    model = K3ModelChunk(config)
    tokens = torch.randint(0, config.vocab_size, (2, 9))
    model.loss(model(tokens), tokens).backward()
    assert [n for n, p in model.named_parameters() if p.grad is None] == [  # one source: softmax of one
        "layers.0.self_attention_res.norm.weight",
        "layers.0.self_attention_res.proj.weight",
    ]
    with pytest.raises(ValueError, match="latent_moe_use_norm"):
        _config(latent_moe_use_norm=True).validate()
    with pytest.raises(ValueError, match="output_gate"):
        _config(linear_attn_config=LinearAttnConfig(output_gate="medium")).validate()
