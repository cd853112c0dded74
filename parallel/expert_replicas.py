"""Replicas planned per micro-batch: the weights of the experts a micro-batch's plan replicates,
exchanged in one fixed-shape all-to-all whose adjoint returns their gradients home.

The plan (`expert_plan.plan_from_load` on the micro-batch's all-gathered loads) is the same on
every rank, so each home rank knows which of its experts every replica slot of the group holds:
it writes them into a `[R, M, F]` send buffer (row `(d, j)`: the expert in rank `d`'s slot `j`
if this rank is its home, else zeros) and after the all-to-all each rank's slot `j` is the sum
over homes of what it received (one home is non-zero). Nothing is read on the host, the shapes
depend on the config only, and backward is autograd's: the gradient of a replica slot travels
back through the same all-to-all into its home expert's rows (`index_select`'s adjoint adds it
into the home stack), so a replica's gradient reaches the home expert's `.grad` before the
gradient reduction, which then reduces it with the home gradients over `expert_dp`.

Wire per rank and MoE layer and micro-batch: `R·M·F` elements each way (weights forward, their
gradients backward), zeros included: the equal-split all-to-all sends every pair's `M` rows.
With a counted exchange (`parallel/device_splits.py`, the `exact` transport's: split sizes as
tensors, NVSHMEM's device-split all-to-all on CUDA) only the replicated matrices travel: a home
sends each of its experts once to every rank that replicates it, packed by destination, and a
rank receives its at most `M` matrices, `M·F` elements on average per rank (`start_fetch`'s
`exchange`). The buffers keep their fixed shapes (`[R·M, F]` out, `[M, F]` in).
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from k3train.parallel.comm import Group
from k3train.parallel.expert_exchange import CountedAllToAll, launch, launch_counted
from k3train.parallel.expert_placement import ReplicaPlacement
from k3train.parallel.expert_plan import ReplicaPlan


class _AllToAll(torch.autograd.Function):
    """Equal-split all-to-all along dim 0; its own adjoint (slice j came from and goes back to j)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return group.all_to_all(x.contiguous())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.group.all_to_all(grad.contiguous()), None


def all_to_all(x: torch.Tensor, group: Group) -> torch.Tensor:
    if group.size == 1:
        return x
    return _AllToAll.apply(x, group)


def replica_send_index(
    plan: ReplicaPlan | ReplicaPlacement, rank: int, num_ranks: int, local: int, slots: int
) -> torch.Tensor:
    """`[R·M]`: for each (destination, replica slot) row of the send buffer, the local index of
    this rank's home expert it carries, or `local` (the zero row) when it carries none."""
    mine = plan.valid & (torch.div(plan.expert, local, rounding_mode="floor") == rank)
    trash = num_ranks * slots
    position = torch.where(mine, plan.dest * slots + plan.slot, trash)
    local_index = torch.where(mine, plan.expert - rank * local, local)
    index = torch.full((trash + 1,), local, dtype=torch.int64, device=plan.expert.device)
    return index.scatter(0, position, local_index)[:trash]


def counted_replica_layout(
    plan: ReplicaPlan | ReplicaPlacement, rank: int, num_ranks: int, local: int, slots: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The counted fetch's layout, from the plan alone (the same on every rank): `(send_index
    [R·M]` (the local index of the home expert each packed send row carries, `local` for the
    zero row; rows grouped by destination, within one by slot), `send_counts [R]`,
    `receive_counts [R]` (matrices from each home), `slot_row [M]` (the received row each of this
    rank's replica slots takes, `M` for the zero row: received rows come home after home, within
    one by slot))."""
    device = plan.expert.device
    home = torch.div(plan.expert, local, rounding_mode="floor")
    entries = plan.expert.shape[0]
    mine = plan.valid & (home == rank)  # entries this rank's experts fill
    key = plan.dest * slots + plan.slot
    order = torch.sort(torch.where(mine, key, num_ranks * slots + key), stable=True).indices
    packed_mine = mine[order]
    send_index = torch.where(packed_mine, plan.expert[order] - rank * local, local)
    ones = torch.ones(entries, dtype=torch.int64, device=device)
    send_counts = torch.zeros(num_ranks, dtype=torch.int64, device=device).scatter_add_(
        0, plan.dest, torch.where(mine, ones, 0)
    )
    here = plan.valid & (plan.dest == rank)  # this rank's filled slots
    receive_counts = torch.zeros(num_ranks, dtype=torch.int64, device=device).scatter_add_(
        0, home, torch.where(here, ones, 0)
    )
    first = receive_counts.cumsum(0) - receive_counts
    same_home_before = (
        here[None, :] & (home[None, :] == home[:, None]) & (plan.slot[None, :] < plan.slot[:, None])
    ).sum(1)
    row = first[home] + same_home_before
    slot_row = torch.full((slots + 1,), slots, dtype=torch.int64, device=device).scatter_(
        0, torch.where(here, plan.slot, slots), torch.where(here, row, slots)
    )[:slots]
    return send_index, send_counts, receive_counts, slot_row


class _CountedReceived:
    """A counted fetch in flight, as `PendingReplicas` wants it: `result()` gives `[1, M, F]`
    (each slot's matrix in place, zeros in empty slots)."""

    def __init__(self, in_flight, slot_row: torch.Tensor):
        self._in_flight, self._slot_row = in_flight, slot_row

    def result(self) -> torch.Tensor:
        received = self._in_flight.result()  # [M, F], home after home
        padded = torch.cat([received, received.new_zeros(1, received.shape[1])])
        return padded.index_select(0, self._slot_row)[None]


class PendingReplicas:
    """A replica fetch in flight (`start_fetch`): `finish()` waits for it and returns this rank's
    replica stacks and the bytes it sent; the overlapped schedule runs the tokens' dispatch and
    the shared experts between the two."""

    def __init__(self, in_flight, sizes: list[int], shapes: list, slots: int, sent_bytes):
        self._in_flight, self._sizes, self._shapes, self._slots = in_flight, sizes, shapes, slots
        self.sent_bytes = sent_bytes

    def finish(self) -> tuple[tuple[torch.Tensor, ...], int | torch.Tensor]:
        received = self._in_flight.result()
        replicas = received.sum(0)  # [M, F]: each slot has at most one non-zero home
        parts = replicas.split(self._sizes, dim=1)
        stacks = tuple(part.reshape(self._slots, *shape) for part, shape in zip(parts, self._shapes))
        return stacks, self.sent_bytes


class StepStacks(Protocol):
    """`step` planning's replica stacks of a layer (`StepReplicaCache.start`): `finish()` gives
    them, after their fetch when it is in flight."""

    def finish(self) -> tuple[torch.Tensor, ...]: ...


class StepOnly:
    """The step's replica stacks alone (`step` planning without top-ups: cached, or in flight at
    the layer's first dispatch of the step), with the bytes to count: `finish()` returns them,
    as `PendingReplicas.finish` does."""

    def __init__(self, step: StepStacks, sent_bytes: int):
        self._step, self.sent_bytes = step, sent_bytes

    def finish(self) -> tuple[tuple[torch.Tensor, ...], int]:
        return self._step.finish(), self.sent_bytes


class StepAndTopUps:
    """The step's replica stacks and this micro-batch's top-ups in flight
    (`parallel.ep_top_up_replicas`): `finish()` returns each stack with the top-up slots after the
    step's, and the bytes of both."""

    def __init__(self, step: StepStacks, top_ups: PendingReplicas, step_bytes: int):
        self._step, self._top_ups, self._step_bytes = step, top_ups, step_bytes

    def finish(self) -> tuple[tuple[torch.Tensor, ...], int | torch.Tensor]:
        step = self._step.finish()
        fetched, sent = self._top_ups.finish()
        stacks = tuple(torch.cat([cached, new.to(cached.dtype)]) for cached, new in zip(step, fetched))
        return stacks, sent + self._step_bytes


def start_fetch(
    stacks: tuple[torch.Tensor, ...],
    plan: ReplicaPlan | ReplicaPlacement,
    group: Group,
    slots: int,
    exchange: CountedAllToAll | None = None,
) -> PendingReplicas:
    """Launch the fetch of this rank's `slots` replica stacks under `plan` (zeros in slots the
    plan leaves empty), in the dtype and shapes of `stacks` (`[G, …]` each) with `slots` groups
    (`parallel/expert_exchange.py`'s launch: its adjoint returns the gradients home the same way);
    with a counted `exchange`, only the replicated matrices travel."""
    local = stacks[0].shape[0]
    shapes = [w.shape[1:] for w in stacks]
    sizes = [math.prod(shape) for shape in shapes]
    flat = torch.cat([w.reshape(local, size) for w, size in zip(stacks, sizes)], dim=1)  # [G, F]
    if exchange is not None and group.size > 1:
        with torch.no_grad():
            send_index, send_counts, receive_counts, slot_row = counted_replica_layout(
                plan, group.rank, group.size, local, slots
            )
        padded = torch.cat([flat, flat.new_zeros(1, flat.shape[1])])
        send = padded.index_select(0, send_index)  # [R·M, F]: the sent matrices first
        in_flight = launch_counted(send, exchange, send_counts, receive_counts, slots)
        sent = 2 * send_counts.sum() * flat.shape[1] * flat.element_size()  # weights now, gradients in backward
        return PendingReplicas(_CountedReceived(in_flight, slot_row), sizes, shapes, slots, sent)
    with torch.no_grad():
        index = replica_send_index(plan, group.rank, group.size, local, slots)
    padded = torch.cat([flat, flat.new_zeros(1, flat.shape[1])])
    send = padded.index_select(0, index).view(group.size, slots, flat.shape[1])
    sent_bytes = 2 * send.numel() * send.element_size()  # weights now, gradients in backward
    return PendingReplicas(launch(send, group), sizes, shapes, slots, sent_bytes)


def fetch_replicas(
    stacks: tuple[torch.Tensor, ...],
    plan: ReplicaPlan,
    group: Group,
    slots: int,
    exchange: CountedAllToAll | None = None,
):
    """`start_fetch` waited for at once: this rank's replica stacks and the bytes it sends for
    them (weights now, gradients in backward)."""
    return start_fetch(stacks, plan, group, slots, exchange).finish()
