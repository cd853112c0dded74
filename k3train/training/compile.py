"""`train.compile=true`: `torch.compile` of the per-layer elementwise chains, nothing else; which
of them is `train.compile_regions` (`norms`, `activations`, `attn_res`, below in that order).

Compiled: every RMSNorm (`model.norm.RMSNorm`: the pre-norms, the AttnRes key norms, the latent
MoE norm) and KDA's gated output norm (`model.kda.GatedRMSNorm`), each with its own
`nn.Module.compile` (torch inlines the module, so instances of one class and shape share the
compiled code), and the GLU activation (SiTU-GLU or SwiGLU) of every dense MLP, shared expert and
routed expert stack, one compiled function per distinct activation. These are chains of
pointwise ops and one reduction that eager PyTorch runs as a dozen kernels with a materialised
fp32 intermediate each; inductor fuses them into one loop forward and one backward. And the
AttnRes mix with the sublayer's input RMSNorm (`norm(mix(sources))`, the plain formula of
`kernels.attn_res.attn_res_mix_plain`, reading the keys `block_keys` computed once per block),
one compiled function per number of sources and pattern of given keys, shared by every mix of the
model: about a hundred small ops per mix become a few loops (`docs/performance.md`).

Not compiled: the matmuls and the chunkwise KDA kernel (already library kernels), the routing
(data-dependent shapes, host reads) and anything that communicates (collectives never sit inside
a compiled region: the TP/SP regions, the expert dispatch and the gradient hooks stay eager). The
elementwise maths is unchanged (inductor may reorder fp32 reductions: losses match eager to
~1e-7 in fp32).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import cast

import torch
from torch import nn

from k3train.kernels.attn_res import attn_res_mix_plain
from k3train.kernels.norms import rms_norm

REGIONS = ("norms", "activations", "attn_res")


def compile_elementwise(model: nn.Module, regions: Sequence[str] = REGIONS) -> dict[str, int]:
    """Compile `model`'s norms, GLU activations and AttnRes mixes (those of `regions`, names as
    `train.compile_regions`) in place; returns how many of each."""
    unknown = set(regions) - set(REGIONS)
    if unknown:
        raise ValueError(f"unknown compile regions {sorted(unknown)}: choose from {list(REGIONS)}")
    from k3train.model.attn_res import AttentionResidual
    from k3train.model.kda import GatedRMSNorm
    from k3train.model.mlp import GLUMLP
    from k3train.model.moe import GroupedExperts
    from k3train.model.norm import RMSNorm

    compiled_activations: dict[object, Callable] = {}
    counts = {"norms": 0, "activations": 0, "attn_res_mixes": 0}
    mix_norm = CompiledMixNorm()
    for module in model.modules():
        if isinstance(module, AttentionResidual):
            if "attn_res" in regions:
                module.compiled_mix_norm = mix_norm
                counts["attn_res_mixes"] += 1
        elif isinstance(module, (RMSNorm, GatedRMSNorm)):
            if "norms" in regions:
                module.compile()
                counts["norms"] += 1
        elif isinstance(module, (GLUMLP, GroupedExperts)) and "activations" in regions:
            activation = module.activation
            key = _activation_key(activation)
            if key not in compiled_activations:
                compiled_activations[key] = torch.compile(activation)
            module.activation = compiled_activations[key]
            counts["activations"] += 1
    return counts


class CompiledMixNorm:
    """`rms_norm(attn_res_mix_plain(sources, ..., inverse_norms, dots), out_weight, out_eps)`,
    compiled once per number of sources and pattern of given keys (each its own `torch.compile`,
    so a model with many distinct counts, as `attn_res: full` has, never meets dynamo's recompile
    limit)."""

    def __init__(self) -> None:
        self.compiled: dict[tuple, Callable] = {}

    def __call__(
        self,
        sources: list[torch.Tensor],
        norm_weight: torch.Tensor,
        query: torch.Tensor,
        eps: float,
        out_weight: torch.Tensor,
        out_eps: float,
        inverse_norms: list | None = None,
        dots: list | None = None,
    ) -> torch.Tensor:
        count = len(sources)
        inverse_norms = [None] * count if inverse_norms is None else list(inverse_norms)
        dots = [None] * count if dots is None else list(dots)
        key = (count, tuple(n is not None for n in inverse_norms), tuple(t is not None for t in dots))
        function = self.compiled.get(key)
        if function is None:
            function = self.compiled[key] = torch.compile(_mix_norm)
        return function(sources, norm_weight, query, eps, out_weight, out_eps, inverse_norms, dots)


def _mix_norm(
    sources: list[torch.Tensor],
    norm_weight: torch.Tensor,
    query: torch.Tensor,
    eps: float,
    out_weight: torch.Tensor,
    out_eps: float,
    inverse_norms: list,
    dots: list,
) -> torch.Tensor:
    return rms_norm(attn_res_mix_plain(sources, norm_weight, query, eps, inverse_norms, dots), out_weight, out_eps)


def _activation_key(activation: Callable) -> object:
    """Equal activations (a `functools.partial` of the same function and arguments) share a key."""
    keywords = getattr(activation, "keywords", None)
    if keywords is not None:  # a functools.partial: it has func and args as well
        partial = cast("functools.partial[object]", activation)
        return (partial.func, partial.args, tuple(sorted(keywords.items())))
    return activation
