"""Gradient clipping by the global L2 norm, ready for cross-rank reductions.

Under data/tensor/pipeline parallelism each rank sees only part of the gradients; the global
norm is `sqrt(sum over ranks of the local squared norms)`. `clip_grad_norm_` is the one place
that computes it: it sums squared norms (`grad_squared_norm`) over *shares* of the gradients,
each share reduced across ranks by its own callback, adds the shares and hands the total to an
optional `reduce_squared_norm` before taking the root. The parallel layer only says which
gradients this rank counts in which share and supplies the reductions (see
docs/data_parallel.md, "The global gradient norm"); a single process counts every gradient in one
share and reduces nothing.
"""

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

ReduceFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class NormShare:
    """A part of the gradients whose squared norms this rank sums locally (the parameters for
    which `counts` is true), then combines across ranks with `reduce` (an all-reduce SUM over
    the ranks that hold distinct parts of it; None: nothing to combine)."""

    counts: Callable[[torch.Tensor], bool]
    reduce: ReduceFn | None = None


def _counts_every_gradient(_param: torch.Tensor) -> bool:
    return True


def grad_squared_norm(grads: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of the squared L2 norms of `grads`: a 0-d fp32 tensor on `device`.

    Each tensor is normed in its dtype promoted to fp32 (float64 gradients in float64), the
    norms are stacked and squared in fp32. An empty list gives a zero on `device`, so a rank
    without gradients still joins its reductions with a tensor NCCL can reduce (a device tensor).
    """
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = [
        torch.linalg.vector_norm(g, 2, dtype=torch.promote_types(g.dtype, torch.float32)).float().to(device)
        for g in grads
    ]
    return torch.stack(norms).square().sum()


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    reduce_squared_norm: ReduceFn | None = None,
    shares: Sequence[NormShare] = (),
) -> torch.Tensor:
    """Scale the gradients in place so their global L2 norm is at most `max_norm`.

    The squared norm is the sum over `shares` (default: one share counting every gradient, not
    reduced) of each share's reduced local sum, then `reduce_squared_norm` of that total. Every
    local gradient is scaled, counted or not (a replicated parameter counts on one rank of its
    group, but every copy is clipped). The norm is computed in fp32 whatever the gradient dtype.
    Returns the total norm (a 0-d fp32 tensor, before clipping) without a host synchronisation.
    `max_norm <= 0` only measures. A non-finite norm is returned as is and the gradients are
    left untouched: the training loop's NaN guard decides what to do with the step.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    parameters = list(parameters)
    with_grads = [(p, p.grad) for p in parameters if p.grad is not None]
    grads = [grad for _, grad in with_grads]
    # The parameters' device, even on a rank where none has a gradient (an empty pipeline stage).
    device = grads[0].device if grads else (parameters[0].device if parameters else torch.device("cpu"))
    parts = []
    for share in shares or (NormShare(_counts_every_gradient),):
        part = grad_squared_norm([grad for p, grad in with_grads if share.counts(p)], device)
        parts.append(share.reduce(part) if share.reduce is not None else part)
    squared_norm = parts[0]
    for part in parts[1:]:
        squared_norm = squared_norm + part
    if reduce_squared_norm is not None:
        squared_norm = reduce_squared_norm(squared_norm)
    total_norm = squared_norm.sqrt()
    if max_norm > 0 and grads:
        # Same coefficient as torch.nn.utils.clip_grad_norm_; torch.where keeps it on the
        # device (no sync) and turns a non-finite norm into "leave the gradients alone".
        coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
        coef = torch.where(torch.isfinite(total_norm), coef, torch.ones_like(coef))
        by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        for grad in grads:
            by_kind[(grad.device, grad.dtype)].append(grad)
        for (grad_device, dtype), same_kind in by_kind.items():
            torch._foreach_mul_(same_kind, coef.to(grad_device, dtype))
    return total_norm
