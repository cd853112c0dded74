"""The routed experts' combine with the routing weights folded into the GLU activation, against
plain indexing (`GroupedExperts.forward_reference`: weights applied to the expert outputs)."""

import dataclasses
from typing import Literal

import pytest
import torch

from k3train.model.config import ModelConfig
from k3train.model.moe import GroupedExperts


def _experts(hidden_act: Literal["situ", "silu"]) -> GroupedExperts:
    config = dataclasses.replace(ModelConfig(), hidden_act=hidden_act)
    experts = GroupedExperts(config, 6).double()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for stack in experts.stacks():
            stack.copy_(0.2 * torch.randn(stack.shape, dtype=torch.float64, generator=generator))
    return experts


@pytest.mark.parametrize("hidden_act", ["situ", "silu"])
def test_folded_weights_match_weighting_the_outputs_in_float64(hidden_act):
    experts = _experts(hidden_act)
    generator = torch.Generator().manual_seed(1)
    tokens, top_k = 13, 3
    # Expert 5 gets no slot (an empty group); one token's weights are zero (dropped slots).
    expert_ids = torch.stack([torch.randperm(5, generator=generator)[:top_k] for _ in range(tokens)])
    latent = torch.randn(tokens, experts.w1.shape[-1], dtype=torch.float64, generator=generator, requires_grad=True)
    weights = torch.rand(tokens, top_k, dtype=torch.float64, generator=generator)
    weights[4] = 0.0
    weights.requires_grad_()
    grad_out = torch.randn(tokens, latent.shape[-1], dtype=torch.float64, generator=generator)
    leaves = (latent, weights, *experts.stacks())
    folded = experts(latent, expert_ids, weights)
    folded_grads = torch.autograd.grad(folded, leaves, grad_out)
    reference = experts.forward_reference(latent, expert_ids, weights)
    reference_grads = torch.autograd.grad(reference, leaves, grad_out)
    torch.testing.assert_close(folded, reference, rtol=1e-12, atol=1e-12)
    for mine, theirs in zip(folded_grads, reference_grads):
        torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12)
    assert torch.count_nonzero(folded_grads[2][5]) == 0  # the empty group's stack gets no gradient


def test_folded_weights_keep_the_latent_dtype_in_bf16():
    experts = _experts("situ").to(torch.bfloat16)
    generator = torch.Generator().manual_seed(2)
    expert_ids = torch.stack([torch.randperm(6, generator=generator)[:2] for _ in range(9)])
    latent = torch.randn(9, experts.w1.shape[-1], generator=generator).to(torch.bfloat16)
    weights = torch.rand(9, 2, generator=generator)  # the router's weights stay fp32
    folded = experts(latent, expert_ids, weights)
    reference = experts.forward_reference(latent, expert_ids, weights)
    assert folded.dtype == torch.bfloat16
    torch.testing.assert_close(folded.float(), reference.float(), rtol=2e-2, atol=2e-2)


def test_without_autograd_the_combine_is_the_reference_bit_for_bit():
    """Evaluation keeps the exported remote code's order (weights applied after the experts)."""
    experts = _experts("situ").float()
    generator = torch.Generator().manual_seed(3)
    expert_ids = torch.stack([torch.randperm(6, generator=generator)[:2] for _ in range(9)])
    latent = torch.randn(9, experts.w1.shape[-1], generator=generator)
    weights = torch.rand(9, 2, generator=generator)
    with torch.no_grad():
        assert torch.equal(experts(latent, expert_ids, weights), experts.forward_reference(latent, expert_ids, weights))
