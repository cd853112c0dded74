"""The LatentMoE layer's allocation-free training paths against their references, in float64:
SiTU-GLU's backward written into its saved buffers (and, with `overwrite_inputs`, its forward
into the GEMM outputs), every combination of requested gradients, and the retain-graph case."""

import itertools

import torch

from k3train.kernels.situ_glu import situ_glu, situ_glu_reference


def _inputs(shape, generator, scale=3.0):
    gate = scale * torch.randn(shape, dtype=torch.float64, generator=generator)
    up = scale * 10 * torch.randn(shape, dtype=torch.float64, generator=generator)
    row_scale = torch.rand(shape[0], dtype=torch.float64, generator=generator)
    return gate, up, row_scale


def _reference(gate, up, row_scale, beta, linear_beta):
    out = situ_glu_reference(gate, up, beta, linear_beta)
    return out if row_scale is None else out * row_scale[:, None]


def test_situ_glu_in_place_backward_matches_the_reference_for_every_requested_gradient(monkeypatch):
    import k3train.kernels.situ_glu as situ_module

    monkeypatch.setattr(situ_module, "CPU_BLOCK_ELEMENTS", 60)  # blocks of 3 rows, the last one short
    generator = torch.Generator().manual_seed(10)
    for beta, linear_beta in [(4.0, 25.0), (1.5, 3.0)]:
        gate0, up0, scale0 = _inputs((33, 20), generator)
        grad_out = torch.randn(33, 20, dtype=torch.float64, generator=generator)
        for with_scale, overwrite in itertools.product((False, True), (False, True)):
            flags = [
                (g, u, s)
                for g, u, s in itertools.product((False, True), repeat=3)
                if (g or u or s) and (with_scale or not s)
            ]
            for needs in flags:
                leaves = [t.clone().requires_grad_(need) for t, need in zip((gate0, up0, scale0), needs)]
                # non-leaf inputs (GEMM outputs): overwrite_inputs may write into them
                gate, up = leaves[0] * 1.0, leaves[1] * 1.0
                scale = leaves[2] if with_scale else None
                fused = situ_glu(gate, up, beta, linear_beta, row_scale=scale, overwrite_inputs=overwrite)
                wanted = [leaf for leaf, need in zip(leaves, needs) if need]
                fused_grads = torch.autograd.grad(fused, wanted, grad_out)
                reference = _reference(*leaves[:2], scale, beta, linear_beta)
                reference_grads = torch.autograd.grad(reference, wanted, grad_out)
                torch.testing.assert_close(fused, reference, rtol=1e-12, atol=1e-12)
                for mine, theirs in zip(fused_grads, reference_grads):
                    torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12)


def test_situ_glu_blocked_backward_takes_any_layout(monkeypatch):
    """Row blocks over 3-d and non-contiguous inputs (a transposed view), row scale per [b, s]."""
    import k3train.kernels.situ_glu as situ_module

    monkeypatch.setattr(situ_module, "CPU_BLOCK_ELEMENTS", 40)
    generator = torch.Generator().manual_seed(13)
    gate = torch.randn(2, 11, 8, dtype=torch.float64, generator=generator).requires_grad_()
    up = (10 * torch.randn(2, 8, 11, dtype=torch.float64, generator=generator)).requires_grad_()
    row_scale = torch.rand(2, 11, dtype=torch.float64, generator=generator).requires_grad_()
    grad_out = torch.randn(2, 11, 8, dtype=torch.float64, generator=generator)
    for overwrite in (False, True):
        inputs = (gate * 1.0, up.transpose(1, 2) * 1.0) if overwrite else (gate, up.transpose(1, 2))
        fused = situ_glu(*inputs, row_scale=row_scale, overwrite_inputs=overwrite)
        grads = torch.autograd.grad(fused, (gate, up, row_scale), grad_out)
        reference = situ_glu_reference(gate, up.transpose(1, 2)) * row_scale.unsqueeze(-1)
        expected = torch.autograd.grad(reference, (gate, up, row_scale), grad_out)
        torch.testing.assert_close(fused, reference, rtol=1e-12, atol=1e-12)
        for mine, theirs in zip(grads, expected):
            torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12)


def test_situ_glu_leaves_its_inputs_alone_unless_told_and_survives_retain_graph():
    generator = torch.Generator().manual_seed(11)
    gate0, up0, scale0 = _inputs((12, 8), generator)
    gate, up, scale = (t.clone().requires_grad_() for t in (gate0, up0, scale0))
    out = situ_glu(gate, up, row_scale=scale)
    assert torch.equal(gate.detach(), gate0) and torch.equal(up.detach(), up0)
    grad_out = torch.randn(12, 8, dtype=torch.float64, generator=generator)
    first = torch.autograd.grad(out, (gate, up, scale), grad_out, retain_graph=True)
    second = torch.autograd.grad(out, (gate, up, scale), grad_out)  # the saved tensors were kept
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    reference = torch.autograd.grad(_reference(gate, up, scale, 4.0, 25.0), (gate, up, scale), grad_out)
    for mine, theirs in zip(first, reference):
        torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12)
    scratch_gate, scratch_up = gate * 1.0, up * 1.0
    situ_glu(scratch_gate, scratch_up, overwrite_inputs=True)
    assert not torch.equal(scratch_gate.detach(), gate0)  # told: its buffer now holds tanh(gate/β1)


def _reference_activation(gate, up, beta, linear_beta, row_scale=None, overwrite_inputs=False, recompute_factors=False):
    return _reference(gate, up, row_scale, beta, linear_beta)


def test_latent_moe_training_path_matches_the_plain_composition_in_float64():
    """The layer's training forward (slot gather by index_select, routing weights inside the
    activation, the in-place activation, the fused latent norm, the shared sum into the shared
    experts' output) against
    the layer written out with the references: values, the input's and every parameter's gradient."""
    import copy
    import dataclasses
    from functools import partial

    from k3train.kernels.norms import rms_norm_reference
    from k3train.model.config import ModelConfig
    from k3train.model.moe import LatentMoE

    torch.manual_seed(0)
    config = dataclasses.replace(ModelConfig(), num_experts=8, num_experts_per_token=3)
    moe = LatentMoE(config).double().train()
    for param in moe.parameters():
        torch.nn.init.normal_(param, std=0.1)
    moe.gate.e_score_correction_bias.copy_(torch.randn(8))
    reference = copy.deepcopy(moe)
    keywords = moe.experts.activation.keywords
    reference.experts.activation = partial(_reference_activation, **keywords)
    reference.shared_experts.activation = partial(_reference_activation, **keywords)
    x = torch.randn(2, 7, config.hidden_size, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(2, 7, config.hidden_size, dtype=torch.float64)

    out = moe(x)
    grads = torch.autograd.grad(out, [x, *moe.parameters()], grad_out)
    tokens = x.reshape(-1, config.hidden_size)
    _, expert_ids, weights = reference.gate(tokens)
    routed = reference.experts.forward_reference(reference.routed_expert_down_proj(tokens), expert_ids, weights)
    norm = reference.routed_expert_norm
    expected = reference.routed_expert_up_proj(rms_norm_reference(routed, norm.weight, norm.eps)).view(
        x.shape
    ) + reference.shared_experts(x)
    expected_grads = torch.autograd.grad(expected, [x, *reference.parameters()], grad_out)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    assert len(grads) == len(expected_grads)
    for mine, theirs in zip(grads, expected_grads):
        torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12)


def test_rms_norm_matches_the_reference_in_float64_and_bf16():
    from k3train.kernels.norms import rms_norm, rms_norm_reference
    from k3train.model.norm import RMSNorm

    generator = torch.Generator().manual_seed(12)
    for shape in [(9, 16), (2, 5, 32)]:
        x = (3 * torch.randn(shape, dtype=torch.float64, generator=generator)).requires_grad_()
        weight = torch.randn(shape[-1], dtype=torch.float64, generator=generator).requires_grad_()
        grad_out = torch.randn(shape, dtype=torch.float64, generator=generator)
        fused = rms_norm(x, weight, 1e-6)
        reference = rms_norm_reference(x, weight, 1e-6)
        torch.testing.assert_close(fused, reference, rtol=1e-12, atol=1e-12)
        for mine, theirs in zip(
            torch.autograd.grad(fused, (x, weight), grad_out), torch.autograd.grad(reference, (x, weight), grad_out)
        ):
            torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12)
        (only_x,) = torch.autograd.grad(rms_norm(x, weight.detach(), 1e-6), (x,), grad_out)
        (reference_x,) = torch.autograd.grad(rms_norm_reference(x, weight.detach(), 1e-6), (x,), grad_out)
        torch.testing.assert_close(only_x, reference_x, rtol=1e-12, atol=1e-12)
    small = torch.randn(3, 4, dtype=torch.float64, generator=generator).requires_grad_()
    small_weight = torch.randn(4, dtype=torch.float64, generator=generator).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, w: rms_norm(a, w, 1e-5), (small, small_weight))
    module = RMSNorm(32, 1e-5)  # the reference is the module's formula
    module.weight.data.normal_(generator=generator)
    plain = torch.randn(6, 32, generator=generator)
    with torch.no_grad():
        assert torch.equal(rms_norm(plain, module.weight, 1e-5), module(plain))
    bf16 = torch.randn(8, 32, generator=generator).bfloat16().requires_grad_()
    out = rms_norm(bf16, module.weight, 1e-5)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), module(bf16.detach()).float(), rtol=2**-7, atol=1e-2)
    out.float().sum().backward()
    assert bf16.grad.dtype == torch.bfloat16 and module.weight.grad.dtype == torch.float32


def test_router_top_k_plus_one_gives_the_experts_and_the_balancers_cutoff():
    """In training the router's one top-(k+1) gives both the experts (= top-k) and the quantile
    balancers' `α`; their statistics equal those of `observe` computing `α` itself."""
    import dataclasses

    from k3train.model.balance import build_balancer
    from k3train.model.config import ModelConfig
    from k3train.model.moe import LatentMoE

    torch.manual_seed(1)
    for balancer in ("quantile", "quantile_histogram", "sign"):
        config = dataclasses.replace(ModelConfig(), num_experts=8, num_experts_per_token=3, balancer=balancer)
        moe = LatentMoE(config).double().train()
        for param in moe.parameters():
            torch.nn.init.normal_(param, std=0.1)
        bias = moe.gate.e_score_correction_bias
        bias.copy_(torch.randn(8) * 0.1)
        x = torch.randn(2, 9, config.hidden_size, dtype=torch.float64, requires_grad=True)
        moe(x).sum().backward()
        tokens = x.detach().reshape(-1, config.hidden_size)
        scores, expert_ids, weights = moe.gate(tokens)
        with_cutoff = moe.gate(tokens, with_cutoff=True)
        assert torch.equal(with_cutoff[1], expert_ids) and torch.equal(with_cutoff[2], weights)
        torch.testing.assert_close(with_cutoff[3], (scores + bias).topk(4, dim=-1).values[:, -1], rtol=0, atol=0)
        assert torch.equal(moe.step_expert_load, torch.bincount(expert_ids.flatten(), minlength=8))
        expected = build_balancer(config)
        expected.observe(scores, bias)
        if balancer == "quantile":
            assert torch.equal(torch.cat(moe.balancer.margins), torch.cat(expected.margins))
        elif balancer == "quantile_histogram":
            assert torch.equal(moe.balancer.counts, expected.counts)
        else:
            assert torch.equal(moe.balancer.loads, expected.loads)
