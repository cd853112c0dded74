"""This rank's share of the global gradient norm, and clipping by it: which gradients a rank
counts (TP shards and expert weights always, TP-replicated ones once per TP column, ZeRO-1
owner-only ones on their owner) and which group sums each share. The norm itself is
`k3train.optim.clip.clip_grad_norm_`'s. Why: docs/data_parallel.md ("The global gradient norm").
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from k3train.optim.clip import NormShare, ReduceFn, clip_grad_norm_
from k3train.parallel.comm import Group
from k3train.parallel.grad_reduce import is_expert_parallel, is_tensor_parallel
from k3train.parallel.state import ParallelState


def counts_in_norm(param: torch.Tensor, state: ParallelState) -> bool:
    """Whether this rank counts `param`'s gradient in the global norm: TP shards and expert
    weights always (distinct across the ranks they are summed over), TP-replicated parameters
    only on tp_rank 0 (else they would count tp times). After `GradientReducer.finish` an
    all-reduced gradient is identical across DP, so no rank of `dp` adds anything new; a
    reduce-scattered one (`grad_on_owner_only`) exists on its owner alone."""
    return is_tensor_parallel(param) or is_expert_parallel(param) or state.tp_rank == 0


def is_owner_only(param: torch.Tensor) -> bool:
    """Its gradient was reduce-scattered to its ZeRO-1 owner (`GradientReducer(owners=...)`)."""
    return bool(getattr(param, "grad_on_owner_only", False))


def norm_shares(state: ParallelState, owner_only: bool = False) -> list[NormShare]:
    """The partial sums of a stage: all-reduced dense gradients counted once, summed over TP;
    all-reduced expert gradients (whole experts, distinct across EP), summed over EP; with
    `owner_only` (the stage has reduce-scattered buckets), the gradients only their owners hold,
    counted once per TP column as above and summed over `data_tensor` (every dp × tp rank of the
    stage, which spans the owners of both the dense and the expert parameters). Every rank of a
    stage runs the same reductions (the EP one is free when ep == 1), so the collectives match
    whatever parameters a rank holds."""
    shares = [
        NormShare(
            lambda p: not is_owner_only(p) and not is_expert_parallel(p) and counts_in_norm(p, state),
            _sum_over(state.tp),
        ),
        NormShare(lambda p: not is_owner_only(p) and is_expert_parallel(p), _sum_over(state.ep)),
    ]
    if owner_only:
        shares.append(NormShare(lambda p: is_owner_only(p) and counts_in_norm(p, state), _sum_over(state.data_tensor)))
    return shares


def _sum_over(group: Group) -> ReduceFn:
    """SUM all-reduce over `group` (in place, returns the tensor; nothing when size 1)."""
    return lambda tensor: group.all_reduce(tensor)


def clip_grad_norm(
    parameters: Iterable[torch.Tensor], max_norm: float, state: ParallelState, owner_only: bool | None = None
) -> torch.Tensor:
    """Clip every local gradient by the global norm over the whole model,
    `pp.SUM(tp.SUM(dense counted once) + ep.SUM(expert) [+ data_tensor.SUM(owner-only)])`;
    returns that norm (before clipping, the same on every rank). `max_norm <= 0` (or inf) only
    measures. The norm itself is `k3train.optim.clip.clip_grad_norm_`'s: this only supplies the
    shares and the PP sum. `owner_only` None: whether any gradient is owner-only, read off the
    marks (which every rank of a stage shares for the model's parameters; masters, which only
    their owners hold, pass it)."""
    parameters = list(parameters)
    if owner_only is None:
        owner_only = any(is_owner_only(p) for p in parameters)
    shares = norm_shares(state, owner_only=owner_only)
    return clip_grad_norm_(parameters, max_norm, reduce_squared_norm=_sum_over(state.pp), shares=shares)
