"""Block keys computed once per block (the model's `KeyedResidualState`) change no result: every
recompute mode gives one loss and one set of gradients, and a state rebuilt from bare blocks (as
a pipeline stage receives them, with no keys) continues to the same output. float64."""

from typing import cast

import pytest
import torch

from k3train.contracts.stage_io import ResidualState
from k3train.model.attn_res import KeyedResidualState
from k3train.model.decoder import DecoderLayer
from k3train.model.k3 import K3ModelChunk, lm_loss
from tests.unit.test_model import randomize_attn_res_queries, small_config

INPUT_IDS = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))


def build(mode: str, recompute: str) -> K3ModelChunk:
    config = small_config(
        attn_res=mode, attn_res_block_size=2, hidden_size=64, vocab_size=64, num_hidden_layers=3, recompute=recompute
    )
    model = K3ModelChunk(config).double()
    randomize_attn_res_queries(model)
    return model


def loss_and_grads(model: K3ModelChunk, forward) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = lm_loss(forward(model), INPUT_IDS)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_same(a, b):
    (loss, grads), (other_loss, other_grads) = a, b
    assert (loss - other_loss).abs() < 1e-12
    assert grads.keys() == other_grads.keys()
    for name, grad in grads.items():
        assert (grad - other_grads[name]).abs().max() < 1e-10, name


@pytest.mark.parametrize("mode", ["block", "full"])
def test_recompute_modes_agree_with_block_keys(mode):
    runs = [
        loss_and_grads(build(mode, recompute), lambda m: m(INPUT_IDS)) for recompute in ("attn_res", "none", "sublayer")
    ]
    assert_same(runs[0], runs[1])
    assert_same(runs[0], runs[2])


@pytest.mark.parametrize("mode", ["block", "full"])
def test_state_without_keys_continues_to_the_same_result(mode):
    """Layers 0..1 with keys, then the state stripped to `ResidualState(partial, blocks)` (what a
    pipeline stage rebuilds from received tensors): the later mixes compute the missing keys."""

    def stripped(model: K3ModelChunk) -> torch.Tensor:
        state = model.embed(INPUT_IDS)
        layers = [cast(DecoderLayer, layer) for layer in model.layers.values()]
        mixes = [mix for layer in layers for mix in layer.attn_res_mixes()] + [model.output_attn_res]
        for index, layer in enumerate(layers[:2]):
            state = layer(state, later=mixes[2 * index + 2 :])
        assert isinstance(state, KeyedResidualState)
        assert any(entry is not None and entry[2] for entry in state.block_keys)  # dots for later mixes
        state = ResidualState(state.partial, list(state.blocks))
        for index, layer in enumerate(layers[2:], start=2):
            state = layer(state, later=mixes[2 * index + 2 :])
        return model.lm_head(model.output_hidden(state))

    for recompute in ("attn_res", "none"):
        with_keys = loss_and_grads(build(mode, recompute), lambda m: m(INPUT_IDS))
        assert_same(with_keys, loss_and_grads(build(mode, recompute), stripped))
