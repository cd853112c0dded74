"""`train.compile=true`: `torch.compile` of the per-layer elementwise chains, nothing else.

Compiled: every RMSNorm (`model.norm.RMSNorm`: the pre-norms, the AttnRes key norms, the latent
MoE norm) and KDA's gated output norm (`model.kda.GatedRMSNorm`), each with its own
`nn.Module.compile` (torch inlines the module, so instances of one class and shape share the
compiled code), and the GLU activation (SiTU-GLU or SwiGLU) of every dense MLP, shared expert and
routed expert stack, one compiled function per distinct activation. These are chains of
pointwise ops and one reduction that eager PyTorch runs as a dozen kernels with a materialised
fp32 intermediate each; inductor fuses them into one loop forward and one backward.

Not compiled: the matmuls and the chunkwise KDA kernel (already library kernels), the routing
(data-dependent shapes, host reads), the AttnRes mix (a list of a varying number of sources) and
anything that communicates (collectives never sit inside a compiled region: the TP/SP regions,
the expert dispatch and the gradient hooks stay eager). The elementwise maths is unchanged
(inductor may reorder fp32 reductions: losses match eager to ~1e-7 in fp32).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn


def compile_elementwise(model: nn.Module) -> dict[str, int]:
    """Compile `model`'s norms and GLU activations in place; returns how many of each."""
    from k3train.model.kda import GatedRMSNorm
    from k3train.model.mlp import GLUMLP
    from k3train.model.moe import LocalExperts
    from k3train.model.norm import RMSNorm

    compiled_activations: dict[object, Callable] = {}
    counts = {"norms": 0, "activations": 0}
    for module in model.modules():
        if isinstance(module, (RMSNorm, GatedRMSNorm)):
            module.compile()
            counts["norms"] += 1
        elif isinstance(module, (GLUMLP, LocalExperts)):
            activation = module.activation
            key = _activation_key(activation)
            if key not in compiled_activations:
                compiled_activations[key] = torch.compile(activation)
            module.activation = compiled_activations[key]
            counts["activations"] += 1
    return counts


def _activation_key(activation: Callable) -> object:
    """Equal activations (a `functools.partial` of the same function and arguments) share a key."""
    keywords = getattr(activation, "keywords", None)
    if keywords is not None:
        return (activation.func, activation.args, tuple(sorted(keywords.items())))
    return activation
