"""SiTU-GLU's closed-form autograd function against its definition (autograd over the formula)."""

import torch

from k3train.kernels.situ_glu import _tanh_through_sigmoid_, situ_glu, situ_glu_reference, swiglu


def _inputs(shape, dtype, generator, scale=3.0):
    gate = (scale * torch.randn(shape, dtype=torch.float64, generator=generator)).to(dtype).requires_grad_()
    up = (scale * 10 * torch.randn(shape, dtype=torch.float64, generator=generator)).to(dtype).requires_grad_()
    return gate, up


def test_situ_glu_values_and_gradients_match_the_reference_in_float64():
    generator = torch.Generator().manual_seed(0)
    for beta, linear_beta in [(4.0, 25.0), (1.5, 3.0)]:
        gate, up = _inputs((64, 48), torch.float64, generator)
        grad_out = torch.randn(64, 48, dtype=torch.float64, generator=generator)
        fused = situ_glu(gate, up, beta, linear_beta)
        fused_grads = torch.autograd.grad(fused, (gate, up), grad_out)
        reference = situ_glu_reference(gate, up, beta, linear_beta)
        reference_grads = torch.autograd.grad(reference, (gate, up), grad_out)
        assert fused.dtype == torch.float64
        torch.testing.assert_close(fused, reference, rtol=1e-12, atol=1e-12)
        for mine, theirs in zip(fused_grads, reference_grads):
            torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12)


def test_situ_glu_passes_gradcheck():
    generator = torch.Generator().manual_seed(1)
    gate, up = _inputs((5, 7), torch.float64, generator, scale=2.0)
    assert torch.autograd.gradcheck(lambda g, u: situ_glu(g, u, 4.0, 25.0), (gate, up))
    assert torch.autograd.gradcheck(lambda g, u: situ_glu(g, u, 0.5, 2.0), (gate, up))


def test_situ_glu_only_the_inputs_that_need_gradients_get_them():
    generator = torch.Generator().manual_seed(2)
    gate, up = _inputs((6, 4), torch.float64, generator)
    frozen_up = up.detach()
    (grad_gate,) = torch.autograd.grad(situ_glu(gate, frozen_up).sum(), (gate,))
    (reference,) = torch.autograd.grad(situ_glu_reference(gate, frozen_up).sum(), (gate,))
    torch.testing.assert_close(grad_gate, reference, rtol=1e-12, atol=1e-12)


def test_situ_glu_stays_bounded_with_finite_gradients_for_huge_inputs():
    gate = torch.tensor([-1e4, -50.0, 0.0, 50.0, 1e4, 3e38], requires_grad=True)
    up = torch.tensor([1e4, -1e4, 3e38, -3e38, 1e4, 1e4], requires_grad=True)
    out = situ_glu(gate, up)
    assert out.abs().max() <= 100.0
    out.sum().backward()
    assert torch.isfinite(gate.grad).all() and torch.isfinite(up.grad).all()
    reference_gate, reference_up = gate.detach().clone().requires_grad_(), up.detach().clone().requires_grad_()
    situ_glu_reference(reference_gate, reference_up).sum().backward()
    torch.testing.assert_close(out, situ_glu_reference(gate.detach(), up.detach()))
    torch.testing.assert_close(gate.grad, reference_gate.grad)
    torch.testing.assert_close(up.grad, reference_up.grad)


def test_situ_glu_computes_bf16_inputs_in_fp32_and_returns_bf16():
    """bf16 in, bf16 out and bf16 gradients; inside, the fp32 computation the reference does
    (so the two agree to bf16 rounding, not to bf16 arithmetic error)."""
    generator = torch.Generator().manual_seed(3)
    gate, up = _inputs((128, 32), torch.bfloat16, generator)
    grad_out = torch.randn(128, 32, generator=generator).to(torch.bfloat16)
    fused = situ_glu(gate, up)
    fused_grads = torch.autograd.grad(fused, (gate, up), grad_out)
    reference = situ_glu_reference(gate, up)
    reference_grads = torch.autograd.grad(reference, (gate, up), grad_out)
    assert fused.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in fused_grads)
    exact = situ_glu_reference(gate.detach().double(), up.detach().double())
    bf16_step = 2.0**-7  # relative spacing of bf16
    assert ((fused.double() - exact).abs() <= bf16_step * exact.abs() + 1e-30).all()  # one rounding
    torch.testing.assert_close(fused, reference, rtol=bf16_step, atol=0.0)
    for mine, theirs in zip(fused_grads, reference_grads):
        torch.testing.assert_close(mine.float(), theirs.float(), rtol=2 * bf16_step, atol=1e-3)


def test_situ_glu_row_scale_matches_scaling_the_reference_in_float64():
    """`row_scale` (the routing weights of expert rows) multiplies each output row, gradient included."""
    generator = torch.Generator().manual_seed(4)
    gate, up = _inputs((10, 6), torch.float64, generator)
    row_scale = torch.rand(10, dtype=torch.float64, generator=generator)
    row_scale[3] = 0.0  # a dropped slot
    row_scale.requires_grad_()
    grad_out = torch.randn(10, 6, dtype=torch.float64, generator=generator)
    fused = situ_glu(gate, up, row_scale=row_scale)
    fused_grads = torch.autograd.grad(fused, (gate, up, row_scale), grad_out)
    reference = situ_glu_reference(gate, up) * row_scale[:, None]
    reference_grads = torch.autograd.grad(reference, (gate, up, row_scale), grad_out)
    torch.testing.assert_close(fused, reference, rtol=1e-12, atol=1e-12)
    for mine, theirs in zip(fused_grads, reference_grads):
        torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12)
    small_gate, small_up = _inputs((4, 3), torch.float64, generator, scale=2.0)
    small_scale = torch.rand(4, dtype=torch.float64, generator=generator).requires_grad_()
    assert torch.autograd.gradcheck(lambda g, u, s: situ_glu(g, u, 4.0, 25.0, s), (small_gate, small_up, small_scale))


def test_swiglu_row_scale_scales_each_row():
    generator = torch.Generator().manual_seed(5)
    gate, up = _inputs((5, 4), torch.float64, generator)
    row_scale = torch.rand(5, dtype=torch.float64, generator=generator)
    torch.testing.assert_close(
        swiglu(gate, up, row_scale), swiglu(gate, up) * row_scale[:, None], rtol=1e-12, atol=1e-12
    )
    bf16 = swiglu(gate.detach().bfloat16(), up.detach().bfloat16(), row_scale.float())
    assert bf16.dtype == torch.bfloat16


def test_situ_glu_without_autograd_is_the_formula_bit_for_bit():
    """Evaluation keeps the formula's operation order (the exported remote code's)."""
    generator = torch.Generator().manual_seed(6)
    gate, up = (t.detach().float() for t in _inputs((8, 16), torch.float64, generator))
    assert torch.equal(situ_glu(gate, up), situ_glu_reference(gate, up))
    with torch.no_grad():
        assert torch.equal(situ_glu(gate.requires_grad_(), up), situ_glu_reference(gate, up))


def test_tanh_through_sigmoid_is_within_two_fp32_units_of_tanh():
    """The bf16 inputs' tanh (2·sigmoid(2x) − 1): absolute error ≤ 2.4e-7 (its docstring's bound)."""
    x = torch.cat(
        [torch.linspace(-20, 20, 400_001), 1e-3 * torch.randn(100_000, generator=torch.Generator().manual_seed(8))]
    )
    error = (_tanh_through_sigmoid_(2 * x).double() - torch.tanh(x.double())).abs().max()
    assert error <= 2.4e-7, error


def test_situ_glu_of_bf16_inputs_near_zero_keeps_the_stated_absolute_bound():
    """Gates and ups near 0, where tanh through sigmoid loses relative (not absolute) accuracy:
    the bf16 output is within one bf16 rounding of the exact value plus β1·β2·2.4e-7."""
    generator = torch.Generator().manual_seed(9)
    gate = (1e-4 * torch.randn(256, 64, generator=generator, dtype=torch.float64)).bfloat16().requires_grad_()
    up = (1e-3 * torch.randn(256, 64, generator=generator, dtype=torch.float64)).bfloat16().requires_grad_()
    fused = situ_glu(gate, up)
    exact = situ_glu_reference(gate.detach().double(), up.detach().double())
    bound = 2.0**-8 * exact.abs() + 4.0 * 25.0 * 2.4e-7 * (1 + 2.0**-8)
    assert ((fused.double() - exact).abs() <= bound).all()
