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
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from k3train.parallel.comm import Group
from k3train.parallel.expert_placement import ReplicaPlacement
from k3train.parallel.expert_plan import greedy_plan_from_load

if TYPE_CHECKING:
    from k3train.parallel.expert import SupportsGroupedForward


def building_graph() -> bool:
    """A training forward (not a recompute inside backward, not evaluation): its loads plan the
    next step's replicas and its replica weights are kept for the step."""
    return torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1


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
    in_flight: StepFetch | None = None
    """The step's fetch while it travels (launched by the layer's first dispatch of the step, and
    shared by a second one before it is waited for: the other half, `parallel.ep_overlap_halves`)."""

    def clear(self) -> None:
        """The step boundary: drop the weights and the loads."""
        self.load.zero_()
        self.flat = None
        self.fetch_bytes = 0
        self.in_flight = None


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


class StepFetch:
    """One layer's step replica fetch in flight (`launch_step_fetch`): `result()` waits for it
    and gives `[slots, F]`, this rank's replica weights (zeros in free slots)."""

    def __init__(self, work, fetched: torch.Tensor, slot_of: list[int], slots: int):
        self._work, self._fetched, self._slot_of, self._slots = work, fetched, slot_of, slots

    def result(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
        flat = self._fetched.new_zeros(self._slots, self._fetched.shape[1])
        index = torch.tensor(self._slot_of, dtype=torch.int64, device=flat.device)
        return flat.index_copy_(0, index, self._fetched)


def launch_step_fetch(
    stacks: tuple[torch.Tensor, ...],
    placement: ReplicaPlacement,
    group: Group,
    slots: int,
) -> StepFetch:
    """Launch the fetch of this rank's replica weights under `placement`: one asynchronous
    all-to-all with host split sizes, each placed replica once."""
    local = stacks[0].shape[0]
    outgoing, send, slot_of, receive = replica_lists(placement, group.rank, group.size, local)
    index = torch.tensor(outgoing, dtype=torch.int64, device=stacks[0].device)
    rows = torch.cat([w.index_select(0, index).reshape(len(outgoing), w[0].numel()) for w in stacks], dim=1)
    if group.size == 1:
        return StepFetch(None, rows, slot_of, slots)
    fetched = rows.new_empty(sum(receive), rows.shape[1])
    work = group.all_to_all_async(rows, fetched, send, receive, f"{group.name}.replicas")
    return StepFetch(work, fetched, slot_of, slots)


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


class PendingStepReplicas:
    """A layer's step replicas from `StepReplicaCache.start`: `finish()` gives the stacks (after
    the step's fetch, if it is still in flight), through `_ReturnHome` when they carry gradients.
    `fetch`: a fetch of this call's own (evaluation: nothing kept for the step)."""

    def __init__(self, cache: StepReplicaCache, state: StepReplicas, stacks, versions, fetch: StepFetch | None = None):
        self._cache, self._state, self._stacks, self._versions, self._fetch = cache, state, stacks, versions, fetch

    def finish(self) -> tuple[torch.Tensor, ...]:
        state, stacks, cache = self._state, self._stacks, self._cache
        if self._fetch is not None:
            with torch.no_grad():
                flat = self._fetch.result()
        else:
            if state.flat is None:  # the step's fetch arrives: a leaf whose gradients collect over the step
                assert state.in_flight is not None, "a step fetch is launched before it is finished"
                with torch.no_grad():
                    fetched = state.in_flight.result()
                state.in_flight = None
                state.flat, state.versions = fetched.requires_grad_(True), self._versions
            flat = state.flat
        if flat.requires_grad and torch.is_grad_enabled():
            shared = cache.shared_returns
            if shared is not None and id(state) in shared:  # the micro-batch's other half: one return home
                flat = shared[id(state)]
            else:
                flat = returning_home(flat, state, cache.group, lambda: cache.last_micro_batch, stacks)
                if shared is not None:
                    shared[id(state)] = flat
        return split_stacks(flat, [w.shape[1:] for w in stacks])


class StepReplicaCache:
    """Every MoE layer's `step` replicas on one EP group, and what a checkpoint keeps of them.

    Per experts module: its `StepReplicas` (made at its first dispatch: the placement restored
    from a checkpoint, else none), the order the modules were marked in (the checkpoint's keys),
    and whether the next backward is the step's last. `finish_step` plans each layer's next
    placement from the step's loads (`planned`: `step` planning of `balanced` dispatch on more
    than one rank; otherwise it only clears the step's weights)."""

    def __init__(
        self, group: Group, num_experts: int, max_replicas: int, tolerance: float, spares: bool, planned: bool
    ):
        self.group, self.num_experts, self.max_replicas = group, num_experts, max_replicas
        self.tolerance = tolerance  # the greedy planner relieves ranks above (1 + tolerance) · mean
        self.spares = spares  # fill free replica slots with the next hottest experts
        self.planned = planned
        self.layers: dict[int, tuple[SupportsGroupedForward, StepReplicas]] = {}
        self.order: list[int] = []  # the experts modules in the order they were marked (checkpoint keys)
        self.restored: dict[int, list[tuple[int, int, int]]] = {}  # placements loaded before a layer ran
        self.last_micro_batch = True  # the next backward returns the replicas' gradients home
        # inside `one_micro_batch`: each layer's `_ReturnHome` output, shared by the halves
        self.shared_returns: dict[int, torch.Tensor] | None = None

    @contextmanager
    def one_micro_batch(self) -> Iterator[None]:
        """The dispatches inside are one micro-batch's (its two halves, `parallel.ep_overlap_halves`):
        they share each layer's `_ReturnHome` node, so that autograd sums their replica gradients
        and, in the step's last backward, they go home in one exchange, as without halves."""
        self.shared_returns = {}
        try:
            yield
        finally:
            self.shared_returns = None

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.group.size

    def mark(self, experts: SupportsGroupedForward) -> None:
        if id(experts) not in self.order:
            self.order.append(id(experts))

    def layer(self, experts: SupportsGroupedForward, device=None) -> StepReplicas:
        key = id(experts)
        if key not in self.layers:
            restored = self.restored.pop(self.order.index(key), None) if key in self.order else None
            size = self.group.size
            if restored is not None:  # resumed: the placement the checkpointed step planned
                placement = ReplicaPlacement.from_host(restored, size, self.max_replicas, device)
            else:
                placement = ReplicaPlacement.empty(size, self.max_replicas, device)  # step 0: no loads yet
            load = torch.zeros(self.num_experts, dtype=torch.int64, device=device)
            self.layers[key] = (experts, StepReplicas(placement, load))
        return self.layers[key][1]

    def replicas(self, experts: SupportsGroupedForward) -> tuple[torch.Tensor, ...]:
        """This step's replica weights `[M, …]` of `experts` (zeros in unused slots): fetched at
        the layer's first dispatch of the step, kept for every micro-batch, their gradients home
        in the step's last backward."""
        return self.start(experts).finish()

    def start(self, experts: SupportsGroupedForward) -> PendingStepReplicas:
        """`replicas` in two parts: at the layer's first dispatch of the step the fetch is
        launched here and waited for by `finish()` (the overlapped schedule runs the dispatch and
        the shared experts between); later the cached weights, nothing in flight."""
        state = self.layer(experts)
        stacks = experts.stacks()
        versions = tuple(w._version for w in stacks)
        if state.flat is not None and versions != state.versions:
            raise RuntimeError(
                "expert weights changed since this step's replicas were fetched: call "
                "ExpertParallel.finish_step after the gradient reduction of every step"
            )
        if state.flat is not None or state.in_flight is not None:
            return PendingStepReplicas(self, state, stacks, versions)
        with torch.no_grad():
            fetch = launch_step_fetch(stacks, state.placement, self.group, self.max_replicas)
        if not building_graph():  # evaluation, a recompute: fetched for this call only
            return PendingStepReplicas(self, state, stacks, versions, fetch)
        state.in_flight = fetch  # kept for the step once it has arrived
        local, rank = self.num_local_experts, self.group.rank
        sent = sum(1 for e, _, _ in state.placement.host if e // local == rank)
        width = sum(w[0].numel() for w in stacks)
        state.fetch_bytes = (
            2 * sent * width * stacks[0].element_size()
        )  # the weights now, gradients in the last backward
        return PendingStepReplicas(self, state, stacks, versions)

    def state_dict(self) -> dict:
        layers = {}
        for index, key in enumerate(self.order):
            if key in self.layers:
                entries = self.layers[key][1].placement.host
            else:
                entries = self.restored.get(index, [])
            layers[str(index)] = [list(entry) for entry in entries]
        return {"ep": self.group.size, "max_replicas_per_rank": self.max_replicas, "layers": layers}

    def load_state_dict(self, state: dict) -> None:
        size = self.group.size
        if (int(state.get("ep", -1)), int(state.get("max_replicas_per_rank", -1))) != (size, self.max_replicas):
            # another layout (the expert stacks reshard): the first step plans without replicas, as step 0
            warnings.warn(
                f"checkpointed expert replicas are for ep={state.get('ep')}, max_replicas_per_rank="
                f"{state.get('max_replicas_per_rank')}; this run has ep={size}, max_replicas_per_rank="
                f"{self.max_replicas}: the first resumed step places no replicas",
                stacklevel=3,
            )
            return
        for name, entries in state.get("layers", {}).items():
            index = int(name)
            entries = [tuple(int(v) for v in entry) for entry in entries]
            key = self.order[index] if index < len(self.order) else None
            if key in self.layers:
                layer = self.layers[key][1]
                layer.placement = ReplicaPlacement.from_host(
                    entries, size, self.max_replicas, layer.placement.expert.device
                )
            else:
                self.restored[index] = entries

    def finish_step(self, state=None) -> None:
        placements = []
        for experts, layer in self.layers.values():
            if layer.flat is not None and layer.flat.grad is not None:  # the same on every EP rank
                self._return_late_gradients(experts, layer, state)
            if self.planned:  # `online` plans in the dispatch: nothing here
                with torch.no_grad():
                    plan = greedy_plan_from_load(layer.load, self.group.size, self.max_replicas, self.tolerance)
                    placement = ReplicaPlacement.from_plan(plan)
                    if self.spares:
                        placement = placement.with_spares(layer.load, plan.rank_load, self.max_replicas)
                    # a step without a training forward through the layer keeps its placement
                    layer.placement = placement.select(layer.load.sum() > 0, layer.placement)
                placements.append(layer.placement)
            layer.clear()
        ReplicaPlacement.read_host(placements)  # the step boundary's one host read, for every layer

    @torch.no_grad()
    def _return_late_gradients(self, experts: SupportsGroupedForward, layer: StepReplicas, state) -> None:
        """Replica gradients still on the replicas after the gradient reduction, into the home
        gradients (scaled as the reduction scales expert gradients, `1/dp`)."""
        if state is not None and state.expert_dp.size > 1:
            raise RuntimeError(
                "replica gradients of this step were not returned before the gradient reduction: the "
                "step's last backward must run after ExpertParallel.set_last_micro_batch(True)"
            )
        assert layer.flat is not None and layer.flat.grad is not None
        delta = gradients_home(layer.flat.grad, layer.placement, self.group, self.num_local_experts)
        if state is not None:
            delta.mul_(1.0 / state.layout.dp)
        stacks = experts.stacks()
        for param, part in zip(stacks, split_stacks(delta, [w.shape[1:] for w in stacks])):
            if param.grad is None:
                param.grad = part.to(param.dtype).clone()
            else:
                param.grad.add_(part.to(param.dtype))
