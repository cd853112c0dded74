"""Evaluation runs the training forward's formulas: the ops that keep a separate path without
autograd (so that evaluation, scoring and the exported Hugging Face code agree bit for bit:
`rms_norm`, `situ_glu`/`swiglu`, the short convolution, MLA's attention call, the routed experts)
are held here to the path training takes, through the whole model.

Both passes run the same model in eval mode on the same tokens; one has autograd recording
(parameters require gradients), the other runs under `torch.no_grad()`. They differ only in
operation order (closed-form backward wrappers, MLA's padded `v`, fused vs unfused passes), so
the logits agree to rounding: at most n·u·max|logit|, with u the unit roundoff of the dtype and
n the length of the longest chain of dependent products and sums one logit depends on, a bound
computed from the config below. Each choice of the ops' variants (SiTU-GLU or SwiGLU, with and
without the latent norm) is run.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from k3train.model.config import ModelConfig
from k3train.model.k3 import K3ModelChunk


def dependent_chain_length(config: ModelConfig, seq_length: int) -> int:
    """Per layer: the mixer (projections of `hidden_size`, the attention's or the recurrence's
    `seq_length` terms, the output projection of heads×dim), the FFN (`hidden_size` in,
    `intermediate_size` out), the two AttnRes mixes (over at most all layers' blocks); then
    the head's `hidden_size`."""
    heads = config.num_attention_heads * max(config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim)
    per_layer = (
        3 * config.hidden_size
        + seq_length
        + heads
        + max(config.intermediate_size, config.moe_intermediate_size * max(1, config.num_shared_experts))
        + 2 * (config.num_hidden_layers + 1)
    )
    return config.num_hidden_layers * per_layer + config.hidden_size


def logits(model: K3ModelChunk, tokens: torch.Tensor, *, record: bool) -> torch.Tensor:
    for parameter in model.parameters():
        parameter.requires_grad_(record)
    with torch.set_grad_enabled(record):
        output = model(tokens)
    return (output.logits if hasattr(output, "logits") else output).detach()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    "changes",
    [{}, {"hidden_act": "silu"}, {"attn_res": "full"}],
    ids=["situ-block", "silu-block", "situ-full"],
)
def test_evaluation_forward_equals_the_training_forward(dtype, changes):
    config = dataclasses.replace(ModelConfig(), num_hidden_layers=4, **changes)
    torch.manual_seed(0)
    model = K3ModelChunk(config, seed=3).to(dtype).eval()
    seq_length = 48
    tokens = torch.randint(0, config.vocab_size, (2, seq_length))

    training = logits(model, tokens, record=True)
    evaluation = logits(model, tokens, record=False)

    unit_roundoff = torch.finfo(dtype).eps / 2
    bound = dependent_chain_length(config, seq_length) * unit_roundoff * training.abs().max().item()
    difference = (training - evaluation).abs().max().item()
    assert difference <= bound, f"{difference:.3e} > {bound:.3e}"
