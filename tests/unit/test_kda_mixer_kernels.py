"""The KDA mixer's elementwise kernels against their plain-PyTorch definitions, in float64
(values and gradients to 1e-12, gradcheck on small shapes): the short convolution + SiLU
(`kernels/short_conv.py`), the L2 and gated RMS norms (`kernels/norms.py`) and the decay gates
(`kernels/kda/gate.py`); then the mixer built on them against one built on the references."""

import dataclasses

import pytest
import torch

from k3train.kernels.kda import kda_gate, kda_gate_reference, kda_gate_unbounded, kda_gate_unbounded_reference
from k3train.kernels.norms import gated_rms_norm, gated_rms_norm_reference, l2_normalize, l2_normalize_reference
from k3train.kernels.short_conv import short_conv_silu, short_conv_silu_reference

TOLERANCE = 1e-12


def leaves(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [tensor.detach().clone().requires_grad_(True) for tensor in tensors]


def assert_same_values_and_gradients(fast, reference, inputs: list[torch.Tensor], seed: int = 7) -> None:
    """`fast(*inputs)` and `reference(*inputs)` (tensors or tuples of tensors) agree, and so do
    the gradients of a random linear functional of their outputs w.r.t. every input."""
    fast_inputs, reference_inputs = leaves(*inputs), leaves(*inputs)
    fast_out, reference_out = fast(*fast_inputs), reference(*reference_inputs)
    if isinstance(fast_out, torch.Tensor):
        fast_out, reference_out = (fast_out,), (reference_out,)
    generator = torch.Generator().manual_seed(seed)
    probes = [torch.randn(out.shape, generator=generator, dtype=out.dtype).to(out.device) for out in reference_out]
    for a, b in zip(fast_out, reference_out):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert (a - b).abs().max() < TOLERANCE
    sum((out * probe).sum() for out, probe in zip(fast_out, probes)).backward()
    sum((out * probe).sum() for out, probe in zip(reference_out, probes)).backward()
    for a, b in zip(fast_inputs, reference_inputs):
        assert a.grad is not None and b.grad is not None
        assert (a.grad - b.grad).abs().max() < TOLERANCE, "gradients differ"


# ---------------------------------------------------------------------- short convolution
def conv_inputs(seq: int, with_tail: bool, taps: int = 4, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seq * 10 + taps)
    x = torch.randn(2, seq, 6, generator=generator, dtype=dtype)
    weight = torch.randn(6, 1, taps, generator=generator, dtype=dtype)
    tail = torch.randn(2, 6, taps - 1, generator=generator, dtype=dtype) if with_tail else None
    return x, weight, tail


@pytest.mark.parametrize("seq", [1, 2, 3, 4, 9])
@pytest.mark.parametrize("with_tail", [False, True])
def test_short_conv_matches_reference(seq, with_tail):
    """Pieces shorter than the tail (decoding: 1 token) included; the new tail and the gradient
    into the old one (context parallelism) too."""
    x, weight, tail = conv_inputs(seq, with_tail)
    if tail is None:
        assert_same_values_and_gradients(
            lambda a, w: short_conv_silu(a, w), lambda a, w: short_conv_silu_reference(a, w), [x, weight]
        )
    else:
        assert_same_values_and_gradients(short_conv_silu, short_conv_silu_reference, [x, weight, tail])


@pytest.mark.parametrize("taps", [2, 4])
def test_short_conv_gradcheck(taps):
    x, weight, tail = leaves(*conv_inputs(5, True, taps))
    assert torch.autograd.gradcheck(lambda a, w, t: short_conv_silu(a, w, t)[0], (x, weight, tail))
    x, weight = leaves(*conv_inputs(2, False, taps)[:2])
    assert torch.autograd.gradcheck(lambda a, w: short_conv_silu(a, w)[0], (x, weight))


def test_short_conv_pieces_equal_one_pass():
    x, weight = leaves(*conv_inputs(11, False)[:2])  # with autograd: the channels-last path
    whole, whole_tail = short_conv_silu(x, weight)
    first, tail = short_conv_silu(x[:, :5], weight)
    second, tail = short_conv_silu(x[:, 5:7], weight, tail)
    third, tail = short_conv_silu(x[:, 7:], weight, tail)
    assert (torch.cat([first, second, third], 1) - whole).abs().max() < TOLERANCE
    assert torch.equal(tail, whole_tail)


def test_short_conv_without_autograd_is_the_reference_and_fp32_agrees():
    """No autograd: the reference itself (bit for bit, channels-first layout). With autograd in
    fp32: the taps are summed oldest first like `F.conv1d`, so the values agree to rounding
    (on this CPU's oneDNN to the bit)."""
    x, weight, tail = conv_inputs(9, True, dtype=torch.float32)
    with torch.no_grad():
        plain, plain_tail = short_conv_silu(x, weight, tail)
    reference, reference_tail = short_conv_silu_reference(x, weight, tail)
    assert torch.equal(plain, reference) and plain.stride() == reference.stride()
    assert torch.equal(plain_tail, reference_tail)
    fast, _ = short_conv_silu(*leaves(x, weight, tail))
    assert fast.is_contiguous() and (fast - reference).abs().max() < 1e-6


def test_norms_and_gates_fp32_forward_equal_references_bit_for_bit():
    """Same ops in the same order as the references, so scoring and exports stay bit-identical."""
    x, gate, weight = norm_inputs(torch.float32)
    assert torch.equal(l2_normalize(x.requires_grad_()), l2_normalize_reference(x))
    assert torch.equal(gated_rms_norm(x, gate, weight, 1e-5), gated_rms_norm_reference(x, gate, weight, 1e-5))
    z, A_log, dt_bias = gate_inputs(torch.float32)
    z.requires_grad_()
    assert torch.equal(kda_gate(z, A_log, dt_bias), kda_gate_reference(z, A_log, dt_bias))
    assert torch.equal(kda_gate_unbounded(z, A_log, dt_bias), kda_gate_unbounded_reference(z, A_log, dt_bias))


def test_short_conv_low_precision_computes_in_fp32():
    """bf16 in, bf16 out; the convolution and SiLU in fp32, then one rounding (the reference
    convolves in bf16, as the remote code: the fast path is at least as close to the exact value)."""
    x, weight, tail = conv_inputs(9, True, dtype=torch.float32)
    x, tail = x.bfloat16(), tail.bfloat16()
    fast, fast_tail = short_conv_silu(x.requires_grad_(), weight, tail)
    reference, reference_tail = short_conv_silu_reference(x, weight, tail)
    assert fast.dtype == torch.bfloat16 and fast_tail.dtype == torch.bfloat16
    assert torch.equal(fast_tail, reference_tail) and fast.is_contiguous()
    exact = short_conv_silu_reference(x.double(), weight.double(), tail.double())[0]
    assert (fast.double() - exact).abs().max() <= (reference.double() - exact).abs().max() + 1e-2
    assert ((fast.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-6).all()  # one bf16 rounding


def test_short_conv_rejects_bad_shapes():
    x, weight, tail = conv_inputs(5, True)
    with pytest.raises(ValueError, match="tail"):
        short_conv_silu(x, weight, tail[..., :2])
    with pytest.raises(ValueError, match="weight"):
        short_conv_silu(x, weight[:3])


# ---------------------------------------------------------------------- norms
def norm_inputs(dtype=torch.float64):
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 3, 8, generator=generator, dtype=dtype)
    gate = torch.randn(2, 5, 3, 8, generator=generator, dtype=dtype)
    weight = torch.rand(8, generator=generator, dtype=dtype) + 0.5
    return x, gate, weight


def test_short_conv_dispatches_to_fla_on_whole_sequences_only(monkeypatch):
    """Where fla's causal convolution can run, a training call without a tail goes to it (the
    weight as `[C, W]`, SiLU fused, zeros before the first token) and still returns the tail of
    its own input; with a tail, or without autograd, the PyTorch paths run. (fla's kernel
    itself is held to the PyTorch path under Triton's interpreter: test_kda_fla_interpreter.py.)"""
    from k3train.kernels.kda import fla_backend

    calls = []

    def fake_causal_conv1d(x, weight, activation=None, **kwargs):
        calls.append((x, weight, activation, kwargs))
        return short_conv_silu_reference(x, weight.unsqueeze(1))[0], None

    generator = torch.Generator().manual_seed(7)
    x = torch.randn(2, 9, 6, generator=generator, requires_grad=True)
    weight = torch.randn(6, 1, 4, generator=generator, requires_grad=True)
    tail = torch.randn(2, 6, 3, generator=generator)
    assert not fla_backend.use_fla_short_conv(x, None)  # CPU tensors
    monkeypatch.setattr(fla_backend, "load_fla_causal_conv1d", lambda: fake_causal_conv1d)
    monkeypatch.setattr(fla_backend, "use_fla_short_conv", lambda x, tail: tail is None)
    output, new_tail = short_conv_silu(x, weight)
    ((called_x, called_weight, activation, kwargs),) = calls
    assert called_x is x and called_weight.shape == (6, 4) and activation == "silu" and not kwargs
    assert torch.equal(called_weight, weight[:, 0])
    assert torch.equal(new_tail, x[:, -3:].transpose(1, 2))
    assert torch.allclose(output, short_conv_silu_reference(x, weight)[0])
    short_conv_silu(x, weight, tail)  # a tail: the written-out PyTorch path
    short_conv_silu(x, weight, backend="torch")
    with pytest.raises(ValueError, match="backend"):
        short_conv_silu(x, weight, backend="fla")
    with torch.no_grad():
        short_conv_silu(x, weight)  # no autograd: the reference
    assert len(calls) == 1


def test_gated_rms_norm_dispatches_to_fla_where_it_runs(monkeypatch):
    """Where fla's fused gated RMSNorm can run, `gated_rms_norm` calls it with KDA's sigmoid gate
    and no bias; `backend="torch"` keeps the written-out path. (fla's kernel itself is held to
    the PyTorch path under Triton's interpreter: test_kda_fla_interpreter.py.)"""
    from k3train.kernels.kda import fla_backend

    calls = []

    def fake_rms_norm_gated(x, gate, weight, bias, activation=None, eps=None, **kwargs):
        calls.append((x, gate, weight, bias, activation, eps, kwargs))
        return gated_rms_norm_reference(x, gate, weight, eps)

    generator = torch.Generator().manual_seed(8)
    x, gate = (torch.randn(2, 5, 3, 8, generator=generator, requires_grad=True) for _ in range(2))
    weight = torch.rand(8, generator=generator, requires_grad=True)
    assert not fla_backend.use_fla_gated_norm(x, gate)  # CPU tensors
    monkeypatch.setattr(fla_backend, "load_fla_rms_norm_gated", lambda: fake_rms_norm_gated)
    monkeypatch.setattr(fla_backend, "use_fla_gated_norm", lambda x, gate: True)
    output = gated_rms_norm(x, gate, weight, 1e-5)
    ((called_x, called_gate, called_weight, bias, activation, eps, kwargs),) = calls
    assert called_x is x and called_gate is gate and called_weight is weight and bias is None and not kwargs
    assert activation == "sigmoid" and eps == 1e-5
    assert torch.allclose(output, gated_rms_norm_reference(x, gate, weight, 1e-5))
    assert torch.allclose(gated_rms_norm(x, gate, weight, 1e-5, backend="torch"), output)
    assert len(calls) == 1
    with pytest.raises(ValueError, match="backend"):
        gated_rms_norm(x, gate, weight, 1e-5, backend="fla")


def test_l2_normalize_matches_reference():
    x, _, _ = norm_inputs()
    x[0, 0, 0] *= 1e-4  # a row near the eps floor
    assert_same_values_and_gradients(l2_normalize, l2_normalize_reference, [x])
    assert torch.autograd.gradcheck(l2_normalize, leaves(x[:, :2]))


def test_gated_rms_norm_matches_reference():
    x, gate, weight = norm_inputs()
    eps = 1e-5
    assert_same_values_and_gradients(
        lambda a, g, w: gated_rms_norm(a, g, w, eps),
        lambda a, g, w: gated_rms_norm_reference(a, g, w, eps),
        [x, gate, weight],
    )
    assert torch.autograd.gradcheck(lambda a, g, w: gated_rms_norm(a, g, w, eps), leaves(x[:, :2], gate[:, :2], weight))


def test_norms_low_precision_keep_dtype_and_match():
    x, gate, weight = norm_inputs(torch.float32)
    x, gate = x.bfloat16(), gate.bfloat16()
    x.requires_grad_()
    assert l2_normalize(x).dtype == torch.bfloat16
    assert torch.equal(l2_normalize(x), l2_normalize_reference(x))  # both fp32 inside, the same ops
    fast, reference = gated_rms_norm(x, gate, weight, 1e-5), gated_rms_norm_reference(x, gate, weight, 1e-5)
    assert fast.dtype == reference.dtype == torch.bfloat16
    assert torch.equal(fast, reference)
    with pytest.raises(ValueError, match="gate"):
        gated_rms_norm(x, gate[..., :4], weight, 1e-5)


# ---------------------------------------------------------------------- decay gates
def gate_inputs(dtype=torch.float64):
    generator = torch.Generator().manual_seed(5)
    z = torch.randn(2, 5, 3, 4, generator=generator, dtype=dtype) * 3
    A_log = torch.randn(3, generator=generator, dtype=dtype) * 0.5
    dt_bias = torch.randn(12, generator=generator, dtype=dtype)
    return z, A_log, dt_bias


@pytest.mark.parametrize("lower_bound", [-5.0, -1.5])
def test_bounded_gate_matches_reference(lower_bound):
    inputs = gate_inputs()
    assert_same_values_and_gradients(
        lambda *a: kda_gate(*a, lower_bound=lower_bound),
        lambda *a: kda_gate_reference(*a, lower_bound=lower_bound),
        list(inputs),
    )
    assert torch.autograd.gradcheck(lambda *a: kda_gate(*a, lower_bound=lower_bound), leaves(*inputs))


def test_unbounded_gate_matches_reference():
    inputs = gate_inputs()
    assert_same_values_and_gradients(kda_gate_unbounded, kda_gate_unbounded_reference, list(inputs))
    assert torch.autograd.gradcheck(kda_gate_unbounded, leaves(*inputs))


def test_gates_fp32_out_of_low_precision_input():
    z, A_log, dt_bias = gate_inputs(torch.float32)
    z = z.bfloat16().requires_grad_(True)
    for fast, reference in ((kda_gate, kda_gate_reference), (kda_gate_unbounded, kda_gate_unbounded_reference)):
        g = fast(z, A_log, dt_bias)
        assert g.dtype == torch.float32
        assert (g - reference(z, A_log, dt_bias)).abs().max() < 1e-5
        (grad,) = torch.autograd.grad(g.sum(), z)
        assert grad.dtype == torch.bfloat16


# ---------------------------------------------------------------------- the mixer
def test_mixer_equals_mixer_on_references(monkeypatch):
    """KimiDeltaAttention (both gates, with and without a cache) gives the same output and
    parameter gradients as the same module computed with the reference kernels."""
    from k3train.kernels.kda import raw_inputs
    from k3train.model import kda as kda_module
    from k3train.model.config import ModelConfig

    def run(module, x, cache_split):
        module.zero_grad()
        if cache_split:
            first, cache = module.forward_with_cache(x[:, :cache_split], None)
            second, _ = module.forward_with_cache(x[:, cache_split:], cache)
            out = torch.cat([first, second], 1)
        else:
            out = module(x)
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)).sum().backward()
        return out.detach(), {name: p.grad.clone() for name, p in module.named_parameters()}

    for lower_bound in (-5.0, None):
        config = ModelConfig()
        config = dataclasses.replace(
            config, linear_attn_config=dataclasses.replace(config.linear_attn_config, gate_lower_bound=lower_bound)
        )
        torch.manual_seed(0)
        module = kda_module.KimiDeltaAttention(config).double()
        with torch.no_grad():
            module.A_log.normal_(0, 0.5)
        x = torch.randn(2, 13, config.hidden_size, dtype=torch.float64)
        for cache_split in (0, 6):
            fast = run(module, x, cache_split)
            with monkeypatch.context() as patch:
                patch.setattr(kda_module, "short_conv_silu", short_conv_silu_reference)
                patch.setattr(kda_module, "gated_rms_norm", gated_rms_norm_reference)
                # q/k normalisation and the gates run next to the kernel (`chunk_kda_from_raw`)
                patch.setattr(raw_inputs, "l2_normalize", l2_normalize_reference)
                patch.setattr(raw_inputs, "kda_gate", kda_gate_reference)
                patch.setattr(raw_inputs, "kda_gate_unbounded", kda_gate_unbounded_reference)
                reference = run(module, x, cache_split)
            assert (fast[0] - reference[0]).abs().max() < 1e-10
            for name, grad in reference[1].items():
                assert (fast[1][name] - grad).abs().max() < 1e-10, name


def test_strided_inputs_and_gradients():
    """Inputs and incoming gradients in a transposed layout (as the chunkwise kernel hands them
    back) give the same values and gradients."""
    generator = torch.Generator().manual_seed(11)
    strided = torch.randn(2, 3, 5, 8, generator=generator, dtype=torch.float64).transpose(1, 2)  # [2, 5, 3, 8]
    gate = torch.randn(2, 5, 3, 8, generator=generator, dtype=torch.float64)
    weight = torch.rand(8, generator=generator, dtype=torch.float64) + 0.5
    assert not strided.is_contiguous()
    assert_same_values_and_gradients(l2_normalize, l2_normalize_reference, [strided])
    for fast, reference in (
        (l2_normalize, l2_normalize_reference),
        (lambda a: gated_rms_norm(a, gate, weight, 1e-5), lambda a: gated_rms_norm_reference(a, gate, weight, 1e-5)),
    ):
        fast_x, reference_x = leaves(strided, strided)
        probe = torch.randn(2, 3, 5, 8, generator=generator, dtype=torch.float64).transpose(1, 2)
        fast_grad = torch.autograd.grad(fast(fast_x), fast_x, probe)[0]
        assert (fast_grad - torch.autograd.grad(reference(reference_x), reference_x, probe)[0]).abs().max() < TOLERANCE
    x = torch.randn(2, 6, 7, generator=generator, dtype=torch.float64).transpose(1, 2)  # [2, 7, 6]
    conv_weight = torch.randn(6, 1, 4, generator=generator, dtype=torch.float64)
    assert_same_values_and_gradients(
        lambda a, w: short_conv_silu(a, w), lambda a, w: short_conv_silu_reference(a, w), [x, conv_weight]
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_kernels_on_cuda_match_references():
    device = torch.device("cuda")
    x, weight, tail = (t.to(device) for t in conv_inputs(9, True))
    assert_same_values_and_gradients(short_conv_silu, short_conv_silu_reference, [x, weight, tail])
    x, gate, norm_weight = (t.to(device) for t in norm_inputs())
    assert_same_values_and_gradients(l2_normalize, l2_normalize_reference, [x])
    assert_same_values_and_gradients(
        lambda a, g, w: gated_rms_norm(a, g, w, 1e-5),
        lambda a, g, w: gated_rms_norm_reference(a, g, w, 1e-5),
        [x, gate, norm_weight],
    )
    inputs = [t.to(device) for t in gate_inputs()]
    assert_same_values_and_gradients(kda_gate, kda_gate_reference, inputs)
    assert_same_values_and_gradients(kda_gate_unbounded, kda_gate_unbounded_reference, inputs)
