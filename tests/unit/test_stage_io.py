"""The rule "when does a block close" is one function (`contracts.stage_io.closes_block`): the
decoder layers, the pipeline plan and the FLOP census all follow it, and it is the rule the
model's forward actually executes."""

import dataclasses
import math
from typing import Literal

import pytest
import torch

from k3train.contracts.stage_io import ResidualState, blocks_before_layer, closes_block
from k3train.model import flops
from k3train.model.config import ModelConfig
from k3train.model.decoder import DecoderLayer
from k3train.model.k3 import K3ModelChunk
from k3train.parallel.pipeline_schedule import PipelineConfigError, PipelinePlan
from k3train.parallel.pipeline_schedule import blocks_before_layer as plan_blocks_before_layer

CASES = [(mode, size) for mode in ("block", "full", "none") for size in (1, 2, 3)]


def tiny_config(attn_res: Literal["block", "full", "none"], block_size: int, layers: int = 7) -> ModelConfig:
    return dataclasses.replace(
        ModelConfig(
            num_hidden_layers=layers,
            hidden_size=32,
            intermediate_size=64,
            num_experts=4,
            num_experts_per_token=2,
            moe_intermediate_size=16,
            routed_expert_hidden_size=16,
            vocab_size=64,
            recompute="none",
        ),
        attn_res=attn_res,
        attn_res_block_size=block_size,
    )


def test_closes_block_is_the_published_rule():
    """`block`: before the mixer of layers 0, S, 2S, …; `full`: before every sublayer; `none`: never."""
    for layer in range(10):
        assert closes_block("block", 3, layer, "mixer") == (layer % 3 == 0)
        assert not closes_block("block", 3, layer, "ffn")
        assert closes_block("full", 3, layer, "mixer") and closes_block("full", 3, layer, "ffn")
        assert not closes_block("none", 3, layer, "mixer") and not closes_block("none", 3, layer, "ffn")
        assert blocks_before_layer("block", 3, layer) == math.ceil(layer / 3)
        assert blocks_before_layer("full", 3, layer) == 2 * layer
        assert blocks_before_layer("none", 3, layer) == 0
    with pytest.raises(ValueError, match="unknown model.attn_res"):
        closes_block("blocks", 2, 0, "mixer")
    with pytest.raises(PipelineConfigError, match="unknown model.attn_res"):
        plan_blocks_before_layer("blocks", 2, 0)


@pytest.mark.parametrize("attn_res,block_size", CASES)
def test_decoder_plan_and_flops_follow_closes_block(attn_res, block_size):
    config = tiny_config(attn_res, block_size)
    layers = config.num_hidden_layers
    with torch.device("meta"):
        model = K3ModelChunk(config)
    for index, layer in model.layers.items():
        assert isinstance(layer, DecoderLayer)
        assert layer.pushes_block_before_mixer() == closes_block(attn_res, block_size, int(index), "mixer")
        assert layer.pushes_block_before_ffn() == closes_block(attn_res, block_size, int(index), "ffn")

    plan = PipelinePlan.build(layers, pp=3, virtual_stages=1, attn_res=attn_res, block_size=block_size)
    boundaries = [start for start, _ in plan.chunks] + [layers]
    assert list(plan.blocks_at) == [blocks_before_layer(attn_res, block_size, layer) for layer in boundaries]

    expected_sources, blocks = [], 0
    for layer in range(layers):
        for sublayer in ("mixer", "ffn"):
            expected_sources.append(blocks + 1)
            blocks += closes_block(attn_res, block_size, layer, sublayer)
    expected_sources.append(blocks + 1)
    assert flops.attn_res_source_counts(config) == ([] if attn_res == "none" else expected_sources)


@pytest.mark.parametrize("attn_res,block_size", CASES)
def test_forward_closes_blocks_where_the_rule_says(attn_res, block_size):
    """The blocks a real forward holds after each layer are the count `blocks_before_layer` gives."""
    config = tiny_config(attn_res, block_size, layers=5)
    torch.manual_seed(0)
    model = K3ModelChunk(config).eval()
    state = model.embed(torch.randint(0, config.vocab_size, (1, 8)))
    with torch.no_grad():
        for index, layer in model.layers.items():
            state = layer(state)
            assert isinstance(state, ResidualState)
            assert len(state.blocks) == blocks_before_layer(attn_res, block_size, int(index) + 1)
