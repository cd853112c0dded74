"""Replicas placed once per step (`parallel.ep_replica_planning: step`): the step's replica
weights of one MoE layer, fetched at its first dispatch, and their gradients returned home inside
the step's last backward.

The weights travel once per step and layer with exact splits (host lists decided at the step
boundary from the placement, not on the dispatch path) and are kept as one leaf `[M, F]`
(`F = 3·I·l`) for every micro-batch of the step. Every use goes through `_ReturnHome`, the
identity on that leaf: in the backward of a micro-batch that is not the step's last it
accumulates the leaf's gradient; in the last one (the pipeline schedule says which,
`ExpertParallel.set_last_micro_batch`, as it tells the gradient reducer) it sends the step's
replica gradients, exactly the `≤ M` placed rows per rank, to their home ranks and returns them as
the home stacks' gradients. Autograd adds them into the home experts' `.grad` before those
parameters' gradient hooks fire, so the gradient reduction reduces them over `expert_dp` with the
home gradients (its buckets, its overlap with backward): no replica-gradient traffic over
`expert_dp` beyond the home gradients' own buckets.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from k3train.parallel.comm import Group
from k3train.parallel.expert_placement import ReplicaPlacement


@dataclass
class StepReplicas:
    """One layer's replicas for the current step: the placement (decided before the step), the
    loads seen this step (the next placement is planned from them), and the fetched weights `flat
    [M, F]`, a leaf whose gradient collects the micro-batches before the step's last backward."""

    placement: ReplicaPlacement
    load: torch.Tensor  # [E] int64: this step's slots per expert over the EP group
    flat: torch.Tensor | None = None
    versions: tuple[int, ...] = ()
    fetch_bytes: int = 0

    def clear(self) -> None:
        """The step boundary: drop the weights and the loads."""
        self.load.zero_()
        self.flat = None
        self.fetch_bytes = 0


def replica_lists(
    placement: ReplicaPlacement, rank: int, num_ranks: int, local: int
) -> tuple[list[int], list[int], list[int], list[int]]:
    """Host bookkeeping of one layer's replica exchange on `rank`: the local indices of the home
    experts it sends (in (destination, slot) order) with the split sizes per rank, and the
    replica slots it fills (in (home, slot) order) with theirs."""
    outgoing = sorted((d, s, e) for e, d, s in placement.host if e // local == rank)
    incoming = sorted((e // local, s) for e, d, s in placement.host if d == rank)
    send = [sum(1 for d, _, _ in outgoing if d == r) for r in range(num_ranks)]
    receive = [sum(1 for h, _ in incoming if h == r) for r in range(num_ranks)]
    return [e - rank * local for _, _, e in outgoing], send, [s for _, s in incoming], receive


def fetch_step_replicas(
    stacks: tuple[torch.Tensor, ...],
    placement: ReplicaPlacement,
    group: Group,
    slots: int,
) -> torch.Tensor:
    """`[slots, F]`: this rank's replica weights under `placement` (zeros in free slots): one
    all-to-all with host split sizes, each placed replica once."""
    local = stacks[0].shape[0]
    outgoing, send, slot_of, receive = replica_lists(placement, group.rank, group.size, local)
    index = torch.tensor(outgoing, dtype=torch.int64, device=stacks[0].device)
    rows = torch.cat([w.index_select(0, index).reshape(len(outgoing), w[0].numel()) for w in stacks], dim=1)
    fetched = group.all_to_all_uneven(rows, send, receive, f"{group.name}.replicas")
    flat = fetched.new_zeros(slots, rows.shape[1])
    return flat.index_copy_(0, torch.tensor(slot_of, dtype=torch.int64, device=flat.device), fetched)


def gradients_home(
    grad: torch.Tensor,
    placement: ReplicaPlacement,
    group: Group,
    local: int,
) -> torch.Tensor:
    """`[local, F]`: the replica gradients `grad [M, F]` of the whole EP group summed into this
    rank's home experts (rows of experts without a replica are zero). Moves only the placed
    replicas' rows (the fetch's all-to-all backwards)."""
    outgoing, send, slot_of, receive = replica_lists(placement, group.rank, group.size, local)
    sent = grad.index_select(0, torch.tensor(slot_of, dtype=torch.int64, device=grad.device))
    home = group.all_to_all_uneven(sent, receive, send, f"{group.name}.replicas")
    index = torch.tensor(outgoing, dtype=torch.int64, device=home.device)
    return home.new_zeros(local, home.shape[1]).index_add_(0, index, home)


def split_stacks(flat: torch.Tensor, shapes: list[torch.Size]) -> tuple[torch.Tensor, ...]:
    """`flat [M, F]` as stacks `[M, *shape]` (views)."""
    sizes = [math.prod(shape) for shape in shapes]
    return tuple(part.reshape(flat.shape[0], *shape) for part, shape in zip(flat.split(sizes, dim=1), shapes))


class _ReturnHome(torch.autograd.Function):
    """Identity on the step's replica leaf `flat`; its backward accumulates into the leaf, or, in
    the step's last backward, returns the step's replica gradients as the home stacks' gradients."""

    @staticmethod
    def forward(ctx, flat, layer, group, is_last, *home):
        ctx.layer, ctx.group, ctx.is_last = layer, group, is_last
        ctx.home_shapes = [w.shape for w in home]
        ctx.home_dtypes = [w.dtype for w in home]
        return flat.view_as(flat)

    @staticmethod
    def backward(ctx, grad):
        nothing = (None,) * (3 + len(ctx.home_shapes))
        if not ctx.is_last():  # an earlier micro-batch: into the leaf
            return (grad, *nothing)
        layer: StepReplicas = ctx.layer
        assert layer.flat is not None, "the step's replica weights were dropped before its last backward"
        if layer.flat.grad is not None:  # what the earlier micro-batches of the step accumulated
            grad = grad + layer.flat.grad
            layer.flat.grad = None
        local = ctx.home_shapes[0][0]
        delta = gradients_home(grad, layer.placement, ctx.group, local)
        parts = split_stacks(delta, [shape[1:] for shape in ctx.home_shapes])
        return (None, *nothing[:3], *(part.to(dtype) for part, dtype in zip(parts, ctx.home_dtypes)))


def returning_home(
    flat: torch.Tensor,
    layer: StepReplicas,
    group: Group,
    is_last: Callable[[], bool],
    home: tuple[torch.Tensor, ...],
) -> torch.Tensor:
    """`flat` through `_ReturnHome` (with the home stacks `home` as the inputs its gradients go to)."""
    return _ReturnHome.apply(flat, layer, group, is_last, *home)
