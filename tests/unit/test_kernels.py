"""Small kernels against their definitions: grouped GEMM, AttnRes mix."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from k3train.kernels.attn_res import attn_res_mix, attn_res_mix_reference, attn_res_mix_rmsnorm
from k3train.kernels.grouped_gemm import (
    GroupPadding,
    bucket_rows,
    expected_padding_rows,
    grouped_mm,
    grouped_mm_reference,
)
from k3train.model.norm import RMSNorm


def test_grouped_mm_reference_matches_torch_grouped_mm_forward():
    """torch 2.13 runs `_grouped_mm` on CPU (fp32 with 16-byte strides), so the reference loop and
    the fused kernel can be compared here; empty groups included."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch has no _grouped_mm")
    generator = torch.Generator().manual_seed(0)
    counts = torch.tensor([3, 0, 5, 0, 8, 1], dtype=torch.int32)
    x = torch.randn(int(counts.sum()), 16, generator=generator)
    weights = torch.randn(len(counts), 16, 32, generator=generator)
    group_ends = counts.cumsum(0).to(torch.int32)
    fused = torch._grouped_mm(x, weights, offs=group_ends)
    with FlopCounterMode(display=False) as counter:  # kernels/grouped_gemm.py gives it a formula
        torch._grouped_mm(x, weights, offs=group_ends)
    assert counter.get_total_flops() == 2 * int(counts.sum()) * 16 * 32
    reference = grouped_mm_reference(x, weights, group_ends)
    assert (fused - reference).abs().max() < 1e-5
    assert (grouped_mm(x, weights, group_ends) - reference).abs().max() < 1e-5
    explicit = torch.cat(
        [x[a:b] @ weights[g] for g, (a, b) in enumerate(zip([0, 3, 3, 8, 8, 16], group_ends.tolist()))]
    )
    assert torch.equal(reference, explicit)


def test_attn_res_mix_matches_its_definition():
    generator = torch.Generator().manual_seed(1)
    sources = [torch.randn(4, 8, dtype=torch.float64, generator=generator) for _ in range(3)]
    gain = torch.rand(8, dtype=torch.float64, generator=generator) + 0.5
    query = torch.randn(8, dtype=torch.float64, generator=generator)
    eps = 1e-6
    keys = [s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + eps) * gain for s in sources]
    scores = torch.stack([(k * query).sum(-1) for k in keys], dim=-1)
    weights = scores.softmax(-1)
    expected = sum(weights[:, i : i + 1] * sources[i] for i in range(3))
    assert (attn_res_mix(sources, gain, query, eps) - expected).abs().max() < 1e-14


def attn_res_case(dtype=torch.float64, count=4, shape=(2, 5, 12), seed=2):
    generator = torch.Generator().manual_seed(seed)
    sources = [(torch.randn(*shape, generator=generator) * (i + 1)).to(dtype).requires_grad_() for i in range(count)]
    gain = (torch.rand(shape[-1], generator=generator) + 0.5).to(dtype).requires_grad_()
    query = torch.randn(shape[-1], generator=generator).to(dtype).requires_grad_()
    out_gain = (torch.rand(shape[-1], generator=generator) + 0.5).to(dtype).requires_grad_()
    return sources, gain, query, out_gain


def values_and_grads(output, inputs, cotangent):
    grads = torch.autograd.grad(output, inputs, cotangent, allow_unused=True)
    return [output.detach()] + [g for g in grads]


@pytest.mark.parametrize("count", [2, 5])
def test_attn_res_fast_mix_and_gradients_match_the_stacked_reference(count):
    """The written-out backward (no stacked keys) against autograd through the definition, float64."""
    sources, gain, query, _ = attn_res_case(count=count)
    inputs = [*sources, gain, query]
    cotangent = torch.randn(sources[0].shape, dtype=torch.float64)
    fast = values_and_grads(attn_res_mix(sources, gain, query, 1e-6), inputs, cotangent)
    reference = values_and_grads(attn_res_mix_reference(sources, gain, query, 1e-6), inputs, cotangent)
    for a, b in zip(fast, reference):
        assert (a - b).abs().max() < 1e-12


def test_attn_res_fused_rmsnorm_matches_norm_of_the_mix():
    """`attn_res_mix_rmsnorm` (backward rebuilds the mixed state) = RMSNorm(reference mix), float64,
    values and every gradient; and gradcheck of the fused op."""
    from k3train.model.norm import RMSNorm

    sources, gain, query, out_gain = attn_res_case(count=3)
    norm = RMSNorm(12, 1e-5).double()
    with torch.no_grad():
        norm.weight.copy_(out_gain)
    inputs = [*sources, gain, query]
    cotangent = torch.randn(sources[0].shape, dtype=torch.float64)
    fused = values_and_grads(
        attn_res_mix_rmsnorm(sources, gain, query, 1e-6, out_gain, 1e-5), inputs + [out_gain], cotangent
    )
    reference = values_and_grads(
        norm(attn_res_mix_reference(sources, gain, query, 1e-6)), inputs + [norm.weight], cotangent
    )
    for a, b in zip(fused, reference):
        assert (a - b).abs().max() < 1e-12
    small = [s[:1, :2].detach().requires_grad_() for s in sources]
    assert torch.autograd.gradcheck(
        lambda *xs: attn_res_mix_rmsnorm(list(xs[:3]), xs[3], xs[4], 1e-6, xs[5], 1e-5), (*small, gain, query, out_gain)
    )


def test_attn_res_fast_mix_in_bf16_matches_the_reference():
    """bf16 sources, fp32 parameters (as in the model): fp32 accumulation in both paths."""
    sources, gain, query, out_gain = attn_res_case(dtype=torch.float32)
    sources = [s.detach().to(torch.bfloat16).requires_grad_() for s in sources]
    cotangent = torch.randn(sources[0].shape).to(torch.bfloat16)
    inputs = [*sources, gain, query]
    fast = values_and_grads(attn_res_mix(sources, gain, query, 1e-6), inputs, cotangent)
    reference = values_and_grads(attn_res_mix_reference(sources, gain, query, 1e-6), inputs, cotangent)
    assert fast[0].dtype == torch.bfloat16 and fast[1].dtype == torch.bfloat16
    for a, b in zip(fast, reference):
        assert (a.float() - b.float()).abs().max() <= 2e-2 * b.float().abs().max()


@pytest.mark.parametrize("dtype,width", [(torch.float64, 16), (torch.float32, 16), (torch.float32, 6)])
@pytest.mark.parametrize("transposed", [False, True])
def test_grouped_mm_gradients_match_the_reference_loop(dtype, width, transposed):
    """The custom backward (torch `_grouped_mm` where it takes the operands: fp32 with 16-byte
    strides; the per-group loop for float64 and odd widths) against autograd through the plain
    loop: output, dx, dW, with empty groups and rows past the last group; weights both contiguous
    and as the transposed view the experts pass; an expanded (stride-0) output gradient."""
    generator = torch.Generator().manual_seed(3)
    counts = torch.tensor([3, 0, 5, 0, 8, 1], dtype=torch.int32)
    group_ends = counts.cumsum(0).to(torch.int32)
    x = torch.randn(int(counts.sum()) + 2, width, generator=generator).to(dtype).requires_grad_()
    if transposed:
        stacked = torch.randn(len(counts), 2 * width, width, generator=generator).to(dtype).requires_grad_()
        weights_of = lambda: stacked.transpose(1, 2)  # noqa: E731
        leaf = stacked
    else:
        leaf = torch.randn(len(counts), width, 2 * width, generator=generator).to(dtype).requires_grad_()
        weights_of = lambda: leaf  # noqa: E731
    tolerance = 1e-12 if dtype == torch.float64 else 1e-4
    results = []
    for mm in (grouped_mm, grouped_mm_reference):
        out = mm(x, weights_of(), group_ends)
        cotangent = torch.ones_like(out).expand_as(out) if mm is grouped_mm else torch.ones_like(out)
        dx, dw = torch.autograd.grad(out, (x, leaf), cotangent)
        results.append((out, dx, dw))
    (out, dx, dw), (ref_out, ref_dx, ref_dw) = results
    assert out.shape == ref_out.shape == (int(counts.sum()), 2 * width)
    assert dw.stride() == leaf.stride()
    for a, b in ((out, ref_out), (dx, ref_dx), (dw, ref_dw)):
        assert (a - b).abs().max() < tolerance
    assert torch.equal(dx[-2:], torch.zeros_like(dx[-2:])) and torch.equal(dw[1], torch.zeros_like(dw[1]))


def test_attn_res_fast_mix_takes_sources_of_mixed_dtypes():
    """Under bf16 autocast the embedding's fp32 output meets bf16 sublayer outputs: the mix runs
    in fp32, returns the first source's dtype and each gradient in its source's dtype."""
    sources, gain, query, out_gain = attn_res_case(dtype=torch.float32)
    sources = [s.detach().to(torch.bfloat16 if i else torch.float32).requires_grad_() for i, s in enumerate(sources)]
    cotangent = torch.randn(sources[0].shape)
    inputs = [*sources, gain, query]
    for fast, reference in (
        (attn_res_mix(sources, gain, query, 1e-6), attn_res_mix_reference(sources, gain, query, 1e-6)),
        (
            attn_res_mix_rmsnorm(sources, gain, query, 1e-6, out_gain, 1e-5),
            RMSNorm(12, 1e-5)
            .to(torch.float32)
            .requires_grad_(False)(attn_res_mix_reference(sources, gain, query, 1e-6))
            * out_gain,
        ),
    ):
        fast_values = values_and_grads(fast, inputs, cotangent)
        reference_values = values_and_grads(reference, inputs, cotangent)
        assert fast.dtype == torch.float32
        assert [g.dtype for g in fast_values[1 : len(sources) + 1]] == [s.dtype for s in sources]
        for a, b in zip(fast_values, reference_values):
            # bf16 gradients are fp32 results rounded once: two orders of the same sum may round
            # to neighbouring bf16 values, one ulp (at most 2^-7 of the value) apart.
            ulp = 2.0**-7 * b.float().abs() if a.dtype == torch.bfloat16 else 0.0
            assert ((a.float() - b.float()).abs() - ulp).max() <= 1e-5 * max(1.0, b.float().abs().max())


def test_bucket_rows_repeat_few_sizes_and_pad_little():
    """Group sizes as they are below 64 rows, rounded to a multiple of 32 below 512 and to 1/16 of
    the power of two above: bounded padding, and few distinct GEMM shapes (oneDNN builds one
    kernel per shape)."""
    sizes = [bucket_rows(rows) for rows in range(1, 1 << 14)]
    assert bucket_rows(0) == 0 and sizes[:64] == list(range(1, 65))
    for rows, padded in enumerate(sizes, start=1):
        assert padded >= rows
        assert padded - rows <= (31 if rows < 512 else rows / 16)
    assert len(set(sizes)) <= 64 + 14 + 16 * 5  # 1..64, 96..512 by 32, then 16 per octave to 2^14


def test_expected_padding_rows_is_the_mean_over_poisson_counts():
    import math

    for mean in (4.0, 40.0, 300.0):
        pmf = [math.exp(c * math.log(mean) - mean - math.lgamma(c + 1)) for c in range(2000)]
        exact = sum(p * (bucket_rows(c) - c) for c, p in enumerate(pmf))
        assert expected_padding_rows(mean) == pytest.approx(exact, rel=1e-9, abs=1e-12)
    assert expected_padding_rows(0.0) == 0.0


def test_group_padding_places_rows_and_zeros():
    group_ends = torch.tensor([3, 3, 73])  # groups of 3, 0 and 70 rows: 70 pads to 96
    padding = GroupPadding.bucketed(group_ends)
    assert padding.ends.tolist() == [3, 3, 99]
    rows = torch.arange(74 * 2, dtype=torch.float32).view(74, 2)  # one row past the last group
    padded = padding.pad(rows)
    assert padded.shape == (99, 2)
    assert torch.equal(padded[:73], rows[:73]) and padded[73:].eq(0).all()
    assert torch.equal(padding.unpad(padded), rows[:73])
    middle = GroupPadding.bucketed(torch.tensor([70, 75]))  # 70 rows pad to 96, then 5 rows
    assert middle.ends.tolist() == [96, 101] and middle.keep.tolist() == [*range(70), *range(96, 101)]
    assert middle.pad(torch.ones(75, 2))[70:96].eq(0).all()


def _bf16_experts_run(experts, rows, group_ends, row_scale, grad_out):
    leaves = (rows, row_scale, *experts.stacks())
    out = experts.forward_sorted(rows, group_ends, row_scale=row_scale)
    return out, torch.autograd.grad(out, leaves, grad_out)


def test_padded_bf16_experts_match_unpadded_and_see_only_bucketed_groups(monkeypatch):
    """On CPU in bf16 the experts pad each group (kernels/grouped_gemm.py). The real rows'
    products are the same fp32-accumulated products of the same bf16 operands, so padded and
    unpadded results differ only where an fp32 summation order flips a bf16 rounding: a few bf16
    units (2⁻⁸ relative) of the output's scale; rows in the wrong place would differ by O(1)."""
    import dataclasses

    from torch.utils._python_dispatch import TorchDispatchMode

    import k3train.model.moe as moe
    from k3train.model.config import ModelConfig

    config = dataclasses.replace(ModelConfig(), hidden_act="situ")
    torch.manual_seed(0)
    experts = moe.GroupedExperts(config, 5)
    with torch.no_grad():
        for stack in experts.stacks():
            stack.copy_(0.1 * torch.randn(stack.shape))
    counts = torch.tensor([70, 0, 33, 131, 5])
    group_ends = counts.cumsum(0)
    rows = torch.randn(int(counts.sum()), experts.w1.shape[-1]).bfloat16().requires_grad_()
    row_scale = torch.rand(rows.shape[0]).requires_grad_()
    grad_out = torch.randn(rows.shape[0], rows.shape[1]).bfloat16()

    class GroupSizes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.sizes: set[int] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ == "_grouped_mm":
                ends = (kwargs or {}).get("offs", args[2] if len(args) > 2 else None).tolist()
                self.sizes.update(end - start for start, end in zip([0] + ends[:-1], ends))
            return func(*args, **(kwargs or {}))

    with GroupSizes() as seen:
        padded_out, padded_grads = _bf16_experts_run(experts, rows, group_ends, row_scale, grad_out)
    assert seen.sizes == {96, 0, 33, 160, 5}  # the buckets of 70, 0, 33, 131, 5
    monkeypatch.setattr(moe, "pads_groups", lambda rows: False)
    out, grads = _bf16_experts_run(experts, rows, group_ends, row_scale, grad_out)
    assert padded_out.shape == out.shape
    for mine, theirs in zip((padded_out, *padded_grads), (out, *grads)):
        scale = theirs.float().abs().max()
        assert (mine.float() - theirs.float()).abs().max() <= 4 * 2**-8 * scale
