"""Gradient clipping by the global L2 norm, ready for a cross-rank reduction.

Under data/tensor/pipeline parallelism each rank sees only part of the gradients; the global
norm is `sqrt(sum over ranks of the local squared norm)`. `clip_grad_norm_` therefore works on
the squared norm and hands it to an optional `reduce_squared_norm` callback (an all-reduce SUM
over the model-parallel group, supplied by the parallel layer) before taking the root. Each
rank must pass only the gradients it counts (replicated parameters on one rank of their group).
"""

from collections import defaultdict
from typing import Callable, Iterable, Optional, Union

import torch

ReduceFn = Callable[[torch.Tensor], torch.Tensor]


def clip_grad_norm_(
    parameters: Union[torch.Tensor, Iterable[torch.Tensor]],
    max_norm: float,
    reduce_squared_norm: Optional[ReduceFn] = None,
) -> torch.Tensor:
    """Scale the gradients in place so their global L2 norm is at most `max_norm`.

    The norm is computed in fp32 whatever the gradient dtype. Returns the total norm (a 0-d
    fp32 tensor, before clipping) without a host synchronisation. `max_norm <= 0` only measures.
    A non-finite norm is returned as is and the gradients are left untouched: the training
    loop's NaN guard decides what to do with the step.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    if grads:
        device = grads[0].device
        norms = [torch.linalg.vector_norm(g, 2, dtype=torch.promote_types(g.dtype, torch.float32)).float().to(device)
                 for g in grads]
        squared_norm = torch.stack(norms).square().sum()
    else:
        # A rank without gradients (e.g. an empty pipeline stage) still joins the reduction.
        squared_norm = torch.zeros((), dtype=torch.float32)
    if reduce_squared_norm is not None:
        squared_norm = reduce_squared_norm(squared_norm)
    total_norm = squared_norm.sqrt()
    if max_norm > 0 and grads:
        # Same coefficient as torch.nn.utils.clip_grad_norm_; torch.where keeps it on the
        # device (no sync) and turns a non-finite norm into "leave the gradients alone".
        coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
        coef = torch.where(torch.isfinite(total_norm), coef, torch.ones_like(coef))
        by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        for g in grads:
            by_kind[(g.device, g.dtype)].append(g)
        for (device, dtype), same_kind in by_kind.items():
            torch._foreach_mul_(same_kind, coef.to(device, dtype))
    return total_norm
