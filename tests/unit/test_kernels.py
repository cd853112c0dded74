"""Small kernels against their definitions: grouped GEMM, AttnRes mix."""

import pytest
import torch

from k3train.kernels.attn_res import attn_res_mix
from k3train.kernels.grouped_gemm import grouped_mm, grouped_mm_reference


def test_grouped_mm_reference_matches_torch_grouped_mm_forward():
    """torch 2.13 runs `_grouped_mm` forward on CPU (its backward is what fails there), so the
    reference loop and the fused kernel can be compared here; empty groups included."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch has no _grouped_mm")
    generator = torch.Generator().manual_seed(0)
    counts = torch.tensor([3, 0, 5, 0, 8, 1], dtype=torch.int32)
    x = torch.randn(int(counts.sum()), 16, generator=generator)
    weights = torch.randn(len(counts), 16, 32, generator=generator)
    group_ends = counts.cumsum(0).to(torch.int32)
    fused = torch._grouped_mm(x, weights, offs=group_ends)
    reference = grouped_mm_reference(x, weights, group_ends)
    assert (fused - reference).abs().max() < 1e-5
    assert torch.equal(grouped_mm(x, weights, group_ends), reference)  # CPU dispatches to the loop
    explicit = torch.cat([x[a:b] @ weights[g] for g, (a, b) in enumerate(zip([0, 3, 3, 8, 8, 16], group_ends.tolist()))])
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
    expected = sum(weights[:, i:i + 1] * sources[i] for i in range(3))
    assert (attn_res_mix(sources, gain, query, eps) - expected).abs().max() < 1e-14
