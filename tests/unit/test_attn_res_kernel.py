"""The AttnRes mix with keys computed once per block (`block_keys`: the inverse key norm, and the
dot with every later mix's score weight, passed to the mixes as `inverse_norms` and `dots`)
against the stacked definition, float64: values and every gradient."""

import pytest
import torch

from k3train.kernels.attn_res import (
    attn_res_mix,
    attn_res_mix_plain,
    attn_res_mix_reference,
    attn_res_mix_rmsnorm,
    block_keys,
    key_inverse_rms,
)
from k3train.kernels.norms import rms_norm
from k3train.model.norm import RMSNorm


def case(count: int, seed: int = 5, shape=(2, 5, 12)):
    generator = torch.Generator().manual_seed(seed)
    leaves = [
        (torch.randn(*shape, generator=generator, dtype=torch.float64) * (i + 1)).requires_grad_() for i in range(count)
    ]
    gains = [(torch.rand(shape[-1], generator=generator, dtype=torch.float64) + 0.5).requires_grad_() for _ in range(3)]
    queries = [torch.randn(1, shape[-1], generator=generator, dtype=torch.float64).requires_grad_() for _ in range(2)]
    return leaves, gains, queries


def two_mixes(leaves, gains, queries, fused: bool, cached: str, plain: bool = False):
    """Two mixes sharing the blocks `leaves[:-1]` (as two sublayers of one block do), the second
    also reading the first's output as its partial; the sum of both, so every gradient meets
    contributions from both mixes. `cached`: "none", "norms" (`key_inverse_rms` per block) or
    "keys" (`block_keys` per block: norms and both mixes' dots). `plain`: `attn_res_mix_plain`
    (what `train.compile=true` compiles; with the fused norm, `rms_norm` of it) instead of the
    written-out mixes."""
    blocks, partial = leaves[:-1], leaves[-1]
    norms = None
    dots: list[list[torch.Tensor | None] | None] = [None, None]
    if cached == "norms":
        norms = [key_inverse_rms(block, 1e-6) for block in blocks] + [None]
    elif cached == "keys":
        keys = [block_keys(block, 1e-6, [(gains[0], queries[0]), (gains[1], queries[1])]) for block in blocks]
        norms = [r for r, _ in keys] + [None]
        dots = [[t[j] for _, t in keys] + [None] for j in range(2)]
    out_gain = gains[2]

    def mix(sources, gain, query, inverse_norms, given_dots):
        if plain:
            mixed = attn_res_mix_plain(sources, gain, query, 1e-6, inverse_norms=inverse_norms, dots=given_dots)
            return rms_norm(mixed, out_gain, 1e-5) if fused else mixed
        if fused:
            return attn_res_mix_rmsnorm(
                sources, gain, query, 1e-6, out_gain, 1e-5, inverse_norms=inverse_norms, dots=given_dots
            )
        return attn_res_mix(sources, gain, query, 1e-6, inverse_norms=inverse_norms, dots=given_dots)

    first = mix(blocks + [partial], gains[0], queries[0], norms, dots[0])
    second = mix(blocks + [partial + first], gains[1], queries[1], norms, dots[1])
    return first + second


def two_mixes_reference(leaves, gains, queries, fused: bool):
    blocks, partial = leaves[:-1], leaves[-1]
    norm = RMSNorm(leaves[0].shape[-1], 1e-5).double()
    with torch.no_grad():
        norm.weight.copy_(gains[2])

    def mix(sources, gain, query):
        mixed = attn_res_mix_reference(sources, gain, query[0], 1e-6)
        return norm(mixed) if fused else mixed

    first = mix(blocks + [partial], gains[0], queries[0])
    second = mix(blocks + [partial + first], gains[1], queries[1])
    return first + second, norm.weight


@pytest.mark.parametrize("plain", [False, True])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("cached", ["none", "norms", "keys"])
@pytest.mark.parametrize("count", [2, 4])
def test_mix_with_per_block_key_norms_matches_the_reference(fused, cached, count, plain):
    leaves, gains, queries = case(count)
    cotangent = torch.randn(leaves[0].shape, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    fast = two_mixes(leaves, gains, queries, fused, cached, plain)
    reference, reference_gain = two_mixes_reference(leaves, gains, queries, fused)
    assert (fast - reference).abs().max() < 1e-12
    inputs = [*leaves, gains[0], gains[1], *queries]
    fast_grads = torch.autograd.grad(fast, inputs + ([gains[2]] if fused else []), cotangent)
    reference_grads = torch.autograd.grad(reference, inputs + ([reference_gain] if fused else []), cotangent)
    for a, b in zip(fast_grads, reference_grads):
        assert a.shape == b.shape and (a - b).abs().max() < 1e-12


def test_key_inverse_rms_gradcheck_and_mix_gradcheck_with_given_norms():
    leaves, gains, queries = case(3, shape=(1, 2, 6))
    assert torch.autograd.gradcheck(lambda v: key_inverse_rms(v, 1e-6), (leaves[0],))
    assert torch.autograd.gradcheck(
        lambda v, g0, q0, g1, q1: torch.stack(
            [block_keys(v, 1e-6, [(g0, q0), (g1, q1)])[0], *block_keys(v, 1e-6, [(g0, q0), (g1, q1)])[1]]
        ),
        (leaves[0], gains[0], queries[0], gains[1], queries[1]),
    )

    def keyed(a, b, c, g, q, out):
        (ra, (ta,)), (rc, (tc,)) = block_keys(a, 1e-6, [(g, q)]), block_keys(c, 1e-6, [(g, q)])
        return attn_res_mix_rmsnorm([a, b, c], g, q, 1e-6, out, 1e-5, inverse_norms=[ra, None, rc], dots=[ta, None, tc])

    assert torch.autograd.gradcheck(keyed, (*leaves, gains[0], queries[0], gains[2]))
    assert torch.autograd.gradcheck(
        lambda a, b, c, g, q, out: attn_res_mix_rmsnorm(
            [a, b, c], g, q, 1e-6, out, 1e-5, inverse_norms=[key_inverse_rms(a, 1e-6), None, key_inverse_rms(c, 1e-6)]
        ),
        (*leaves, gains[0], queries[0], gains[2]),
    )


def test_inverse_norms_must_match_the_sources():
    leaves, gains, queries = case(3)
    with pytest.raises(ValueError, match="inverse_norms"):
        attn_res_mix(leaves, gains[0], queries[0], 1e-6, inverse_norms=[None])
    with pytest.raises(ValueError, match="dots"):
        attn_res_mix(leaves, gains[0], queries[0], 1e-6, dots=[None, None])
