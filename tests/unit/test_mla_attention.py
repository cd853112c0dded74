"""MLA's causal attention with v zero-padded to the q/k head dim, against the unpadded SDPA call."""

import dataclasses

import torch

import k3train.model.mla as mla_module
from k3train.model.config import ModelConfig
from k3train.model.mla import GatedMLA, causal_attention, causal_attention_reference


def _mla_shaped(dtype, generator, batch=2, seq=37, heads=3, nope=16, rope=8, v_dim=12):
    def leaf(*shape):
        return torch.randn(*shape, dtype=dtype, generator=generator).requires_grad_()

    return (
        leaf(batch, seq, heads, nope + rope),
        leaf(batch, seq, heads, nope),
        leaf(batch, seq, 1, rope),
        leaf(batch, seq, heads, v_dim),
    )


def test_padded_attention_equals_the_unpadded_call_in_float64():
    generator = torch.Generator().manual_seed(0)
    for v_dim in (12, 24, 30):  # narrower than, equal to and wider than the q/k head dim (24)
        q, k_nope, k_rope, v = _mla_shaped(torch.float64, generator, v_dim=v_dim)
        heads = q.shape[2]
        scale = q.shape[-1] ** -0.5
        grad_out = torch.randn(*q.shape[:3], v_dim, dtype=torch.float64, generator=generator)
        inputs = (q, k_nope, k_rope, v)
        padded = causal_attention(q, k_nope, k_rope.expand(-1, -1, heads, -1), v, scale)
        padded_grads = torch.autograd.grad(padded, inputs, grad_out)
        reference = causal_attention_reference(q, torch.cat([k_nope, k_rope.expand(-1, -1, heads, -1)], -1), v, scale)
        reference_grads = torch.autograd.grad(reference, inputs, grad_out)
        assert padded.shape == reference.shape
        torch.testing.assert_close(padded, reference, rtol=1e-12, atol=1e-12)
        for mine, theirs in zip(padded_grads, reference_grads):
            torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12)


def _ops(function):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        function()
    return {event.name for event in prof.events()}


def test_padded_attention_takes_a_fused_sdpa_kernel_on_cpu():
    """The reason for the padding: with one head dim SDPA does not materialise the scores
    (no `_softmax`), while the unpadded call does."""
    generator = torch.Generator().manual_seed(1)
    q, k_nope, k_rope, v = (t.detach().float().requires_grad_() for t in _mla_shaped(torch.float64, generator))
    k_rope = k_rope.expand(-1, -1, q.shape[2], -1)
    padded = _ops(lambda: causal_attention(q, k_nope, k_rope, v, 0.2))
    unpadded = _ops(lambda: causal_attention_reference(q, torch.cat([k_nope, k_rope], -1), v, 0.2))
    assert "aten::_softmax" in unpadded and "aten::_softmax" not in padded


def test_without_autograd_the_unpadded_call_runs_bit_for_bit():
    """Evaluation and scoring keep the call the exported remote code makes (equal fp32 logits)."""
    generator = torch.Generator().manual_seed(2)
    q, k_nope, k_rope, v = (t.detach().float() for t in _mla_shaped(torch.float64, generator))
    k_rope = k_rope.expand(-1, -1, q.shape[2], -1)
    reference = causal_attention_reference(q, torch.cat([k_nope, k_rope], -1), v, 0.2)
    assert torch.equal(causal_attention(q, k_nope, k_rope, v, 0.2), reference)
    with torch.no_grad():
        trainable = [t.clone().requires_grad_() for t in (q, k_nope, k_rope, v)]
        assert "aten::_softmax" in _ops(lambda: causal_attention(*trainable, 0.2))


def test_context_parallel_path_gets_the_unpadded_values(monkeypatch):
    """With context parallelism the MLA layer hands `context_attention` the plain k and v."""
    config = dataclasses.replace(
        ModelConfig(),
        hidden_size=64,
        num_attention_heads=2,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
    )
    mla = GatedMLA(config).double()
    seen = {}

    class WholeSequence:  # a one-rank stand-in: size 2 to take the CP branch, identity gather
        size = 2

        @staticmethod
        def gather_sequence(x):
            return x

    def recording_attention(q, k, v, cp, scale, document_starts=None):
        seen["k"], seen["v"] = k.shape[-1], v.shape[-1]
        return causal_attention_reference(q, k, v, scale)

    monkeypatch.setattr(mla_module, "context_attention", recording_attention)
    x = torch.randn(2, 9, 64, dtype=torch.float64)
    plain = mla(x)
    mla.context_parallel = WholeSequence()
    through_cp = mla(x)
    assert seen == {"k": 24, "v": 12}
    torch.testing.assert_close(through_cp, plain, rtol=1e-12, atol=1e-12)
