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
gradients backward), zeros included: the equal-split all-to-all sends every pair's `M` rows. A
one-sided read (each slot pulling its `F` elements from the home rank, as NVSHMEM or
`torch.distributed._symmetric_memory` allow on GPUs) would move `M·F`; not written here (it
cannot run on the CPU machines this tree is tested on).
"""

from __future__ import annotations

import math

import torch

from k3train.parallel.comm import Group
from k3train.parallel.expert_exchange import launch
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


def replica_send_index(plan: ReplicaPlan, rank: int, num_ranks: int, local: int, slots: int) -> torch.Tensor:
    """`[R·M]`: for each (destination, replica slot) row of the send buffer, the local index of
    this rank's home expert it carries, or `local` (the zero row) when it carries none."""
    mine = plan.valid & (torch.div(plan.expert, local, rounding_mode="floor") == rank)
    trash = num_ranks * slots
    position = torch.where(mine, plan.dest * slots + plan.slot, trash)
    local_index = torch.where(mine, plan.expert - rank * local, local)
    index = torch.full((trash + 1,), local, dtype=torch.int64, device=plan.expert.device)
    return index.scatter(0, position, local_index)[:trash]


class PendingReplicas:
    """A replica fetch in flight (`start_fetch`): `finish()` waits for it and returns this rank's
    replica stacks and the bytes it sent; the overlapped schedule runs the tokens' dispatch and
    the shared experts between the two."""

    def __init__(self, in_flight, sizes: list[int], shapes: list, slots: int, sent_bytes: int):
        self._in_flight, self._sizes, self._shapes, self._slots = in_flight, sizes, shapes, slots
        self.sent_bytes = sent_bytes

    def finish(self) -> tuple[tuple[torch.Tensor, ...], int]:
        received = self._in_flight.result()
        replicas = received.sum(0)  # [M, F]: each slot has at most one non-zero home
        parts = replicas.split(self._sizes, dim=1)
        stacks = tuple(part.reshape(self._slots, *shape) for part, shape in zip(parts, self._shapes))
        return stacks, self.sent_bytes


class ReadyReplicas:
    """Replica stacks already at hand (`step` planning's cached ones), with the bytes to count:
    `finish()` returns them, as `PendingReplicas.finish` does."""

    def __init__(self, stacks: tuple[torch.Tensor, ...], sent_bytes: int):
        self._stacks, self.sent_bytes = stacks, sent_bytes

    def finish(self) -> tuple[tuple[torch.Tensor, ...], int]:
        return self._stacks, self.sent_bytes


def start_fetch(stacks: tuple[torch.Tensor, ...], plan: ReplicaPlan, group: Group, slots: int) -> PendingReplicas:
    """Launch the fetch of this rank's `slots` replica stacks under `plan` (zeros in slots the
    plan leaves empty), in the dtype and shapes of `stacks` (`[G, …]` each) with `slots` groups
    (`parallel/expert_exchange.py`'s launch: its adjoint returns the gradients home the same way)."""
    local = stacks[0].shape[0]
    shapes = [w.shape[1:] for w in stacks]
    sizes = [math.prod(shape) for shape in shapes]
    flat = torch.cat([w.reshape(local, size) for w, size in zip(stacks, sizes)], dim=1)  # [G, F]
    with torch.no_grad():
        index = replica_send_index(plan, group.rank, group.size, local, slots)
    padded = torch.cat([flat, flat.new_zeros(1, flat.shape[1])])
    send = padded.index_select(0, index).view(group.size, slots, flat.shape[1])
    sent_bytes = 2 * send.numel() * send.element_size()  # weights now, gradients in backward
    return PendingReplicas(launch(send, group), sizes, shapes, slots, sent_bytes)


def fetch_replicas(
    stacks: tuple[torch.Tensor, ...], plan: ReplicaPlan, group: Group, slots: int
) -> tuple[tuple[torch.Tensor, ...], int]:
    """`start_fetch` waited for at once: this rank's replica stacks and the bytes it sends for
    them (weights now, gradients in backward)."""
    return start_fetch(stacks, plan, group, slots).finish()
