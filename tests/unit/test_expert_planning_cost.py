"""What the replica planning costs and what it gives: a fixed number of tensor operations per
dispatch whatever the EP size, one host read per step boundary for all layers, and plans as good
as the greedy it replaced (`expert_plan_reference.py`) where it matters, the per-destination
capacity.

Operations are counted with a dispatch mode (every aten operation that reaches a kernel; views
and other aliases, which launch nothing, are counted apart)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from k3train.parallel.expert import ExpertParallel
from k3train.parallel.expert_placement import ReplicaPlacement, top_up_placement
from k3train.parallel.expert_plan import (
    apply_placement,
    capacity_per_destination,
    greedy_plan_from_load,
    plan_from_load,
)
from tests.unit.expert_plan_reference import host_spares


class KernelCounter(TorchDispatchMode):
    """Counts the operations run inside it: `kernels` (a launch each on a GPU) and `views`."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels = self.views = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.is_view:
            self.views += 1
        else:
            self.kernels += 1
        return func(*args, **(kwargs or {}))


def lognormal_load(experts: int, sigma: float, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(experts, generator=generator) * sigma).exp().mul(200).long()


def planning_ops(ranks: int, replicas: int = 2) -> tuple[int, int, int, int]:
    """(kernels, views) of `plan_from_load` (the per-dispatch plan of `online` replicas) and of a
    step placement's spares, at K3's 896 experts over `ranks`."""
    load = lognormal_load(896, 1.0, seed=ranks)
    online = KernelCounter()
    with online:
        plan_from_load(load, ranks, replicas)
    plan = greedy_plan_from_load(load, ranks, replicas, 0.05)
    step = KernelCounter()
    with step:
        ReplicaPlacement.from_plan(plan).with_spares(load, plan.rank_load, replicas)
    return online.kernels, online.views, step.kernels, step.views


def test_planning_runs_a_fixed_number_of_operations_whatever_the_ep_size():
    # measured: online 50 kernels + 14 views at every R (the greedy it replaced: 445 operations at
    # R = 4, 6,565 at 64, views included); a step placement's spares 69 + 2 (the host loop it
    # replaced read the device once per expert it looked at)
    counts = {ranks: planning_ops(ranks) for ranks in (8, 64, 224)}
    assert len(set(counts.values())) == 1, counts
    online_kernels, _, step_kernels, _ = counts[64]
    assert online_kernels <= 60, counts
    assert step_kernels <= 80, counts


class HostReads:
    """Counts `.item()`, `.tolist()`, `.cpu()` and the Python conversions of tensors inside."""

    names = ("item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")

    def __enter__(self):
        self.count = 0
        self.saved = {name: getattr(torch.Tensor, name) for name in self.names}
        for name in self.names:
            original = self.saved[name]

            def counted(tensor, *args, _original=original, **kwargs):
                self.count += 1
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, counted)
        return self

    def __exit__(self, *exc):
        for name, method in self.saved.items():
            setattr(torch.Tensor, name, method)


def test_the_step_boundary_reads_the_device_once_for_every_layer():
    """`finish_step` of `step` replicas plans every layer's next placement (greedy and spares) on
    the device and reads all of them in one `.tolist()`."""
    group = SimpleNamespace(size=8, rank=1, name="ep")
    dispatcher = ExpertParallel(group, 64, "balanced", 1.25, 2, replica_planning="step")
    modules = [
        SimpleNamespace(**{name: torch.nn.Parameter(torch.zeros(8, 2, 2)) for name in ("w1", "w3", "w2")})
        for _ in range(6)
    ]
    for index, module in enumerate(modules):
        dispatcher.mark_expert_params(module)
        dispatcher._layer(module).load += lognormal_load(64, 1.5, seed=index)
    with HostReads() as reads:
        dispatcher.finish_step()
    assert reads.count == 1
    placements = [dispatcher._layer(module).placement for module in modules]
    assert all(placement.host_entries for placement in placements)
    for placement in placements:  # the host lists are the device entries
        assert placement.host == ReplicaPlacement.from_host(placement.host, 8, 2).host
        assert torch.equal(placement.expert, ReplicaPlacement.from_host(placement.host, 8, 2).expert)


def routings():
    """Random loads: uniform, log-normal (σ 1 and 2) and every token on 16 hot experts."""
    for seed in range(96):
        ranks, local = (4, 8, 16, 32)[seed % 4], (2, 4, 8, 14)[seed // 4 % 4]
        experts = ranks * local
        generator = torch.Generator().manual_seed(seed)
        kind = seed // 16 % 4
        if kind == 0:
            load = torch.randint(0, 100, (experts,), generator=generator)
        elif kind in (1, 2):
            load = (torch.randn(experts, generator=generator) * kind).exp().mul(50).long()
        else:
            load = torch.randint(0, 3, (experts,), generator=generator)
            load[: min(experts, 16)] += 1000
        yield seed, ranks, local, load


@pytest.mark.parametrize("replicas", [2, 3])
def test_plans_stay_within_the_destination_capacity_where_the_greedy_does(replicas):
    """The fixed-operation planner moves slots in the greedy's order while the ranks keep theirs
    and differs where the greedy re-ranks, so plans are not equal; what a drop depends on is
    whether every planned destination load is within `C_dest = ceil(1.25 · mean)`: wherever the
    greedy gets there, so must this planner (with two or more replica slots per rank; with one,
    a receiver cannot take a second piece and the line merge is worse than the greedy: not the
    configuration of any recipe). Plus the invariants every plan keeps."""
    reached = 0
    for seed, ranks, local, load in routings():
        greedy = greedy_plan_from_load(load, ranks, replicas)
        capacity = math.ceil(1.25 * int(load.sum()) / ranks)
        if int(greedy.rank_load.max()) <= capacity:
            reached += 1
            plan = plan_from_load(load, ranks, replicas)
            assert int(plan.rank_load.max()) <= capacity, (seed, plan.rank_load, greedy.rank_load)
        for plan in (plan_from_load(load, ranks, replicas), plan_from_load(load, ranks, replicas, 0.05)):
            check_invariants(plan, ranks, local, replicas)
    assert reached >= 70  # most routings are within reach (the rest: too few slots for the skew)


def check_invariants(plan, ranks: int, local: int, replicas: int) -> None:
    """What every plan keeps: intervals that tile each expert's load, at most `M` replicas per rank in
    slots 0, 1, …, never on the home rank, and the rank loads it states."""
    valid = plan.valid
    held = plan.home.clone().index_add_(0, plan.expert[valid], plan.amount[valid])
    assert torch.equal(held, plan.load) and torch.all(plan.home >= 0)
    assert torch.all(plan.expert[valid] // local != plan.dest[valid])  # never on its home
    for rank in range(ranks):  # at most M, in slots 0, 1, …
        slots = sorted(plan.slot[valid & (plan.dest == rank)].tolist())
        assert slots == list(range(len(slots))) and len(slots) <= replicas
    rank_load = plan.home.view(ranks, local).sum(1).index_add_(0, plan.dest[valid], plan.amount[valid])
    assert torch.equal(rank_load, plan.rank_load)
    for expert in plan.expert[valid].unique().tolist():  # replica intervals follow the home share
        position = int(plan.home[expert])
        for j in (valid & (plan.expert == expert)).nonzero().flatten().tolist():
            assert int(plan.start[j]) == position
            position += int(plan.amount[j])


def test_balanced_loads_get_no_replicas_and_one_hot_expert_spreads_over_every_rank():
    assert not plan_from_load(torch.full((64,), 10), 8, 2).valid.any()
    load = torch.zeros(896, dtype=torch.int64)
    load[0] = 64 * 16_384  # every slot of every rank on expert 0
    plan = plan_from_load(load, 64, 2)
    assert int(plan.rank_load.max()) == 16_384 == int(plan.rank_load.min())
    assert int(plan.rank_load.max()) <= capacity_per_destination(16_384, 1, 64, 1.25)


def test_spares_follow_the_host_rule_except_on_the_home_rank():
    """The device spares equal the former host loop (hottest unreplicated expert to the least
    loaded rank with a free slot) wherever that loop never skipped a home rank; where it did (the
    least loaded free slot was the expert's home), the device rule leaves that slot free."""
    equal = 0
    for seed, ranks, _local, load in routings():
        plan = greedy_plan_from_load(load, ranks, 2, 0.05)
        placement = ReplicaPlacement.from_plan(plan)
        spared = placement.with_spares(load, plan.rank_load, 2)
        reference = host_spares(placement.host, load, plan.rank_load, 2)
        mine = spared.host
        assert mine[: len(placement.host)] == placement.host
        if mine == reference:
            equal += 1
            continue
        # where they part, the device rule paired a candidate with a free slot on its own home
        local = load.shape[0] // ranks
        first = next(i for i, (a, b) in enumerate(zip(mine + [None] * len(reference), reference)) if a != b)
        replicated = {expert for expert, _, _ in placement.host}
        candidates = [e for e in torch.sort(load, descending=True, stable=True).indices.tolist()]
        candidates = [e for e in candidates if e not in replicated and int(load[e]) > 0]
        used = [sum(1 for _, d, _ in placement.host if d == r) for r in range(ranks)]
        order = torch.sort(plan.rank_load, stable=True).indices.tolist()
        free = [r for r in order for slot in range(2) if slot >= used[r]]
        conflicts = [i for i, (e, r) in enumerate(zip(candidates, free)) if e // local == r]
        assert conflicts and conflicts[0] + len(placement.host) <= first, (seed, first, conflicts)
    assert equal >= 16  # measured 20 of the 96 (small R: the hottest experts' homes are often the least loaded)


def top_up_ops(ranks: int, replicas: int = 2, top_up: int = 1) -> tuple[int, int]:
    """(kernels, views) of one micro-batch's top-up planning under a step placement
    (`top_up_placement`: the placement's amounts, the residual plan, the merge), at K3's 896
    experts and 1,024 tokens of top-16 per rank, the sources' counts drawn log-normal."""
    generator = torch.Generator().manual_seed(ranks)
    popularity = (torch.randn(ranks, 896, generator=generator)).exp()
    counts = torch.distributions.Multinomial(1024 * 16, popularity).sample().long()
    load = counts.sum(0)
    placement = ReplicaPlacement.from_plan(greedy_plan_from_load(load, ranks, replicas, 0.05))
    capacity = capacity_per_destination(1024, 16, ranks, 1.25)
    counter = KernelCounter()
    with counter:
        top_up_placement(counts, placement, capacity, top_up, 0.25)
    return counter.kernels, counter.views


def test_top_up_planning_runs_a_fixed_number_of_operations_whatever_the_ep_size():
    # the merge and the residual plan are loop-free; apply_placement's rounds are a fixed four per
    # level (measured: 452 kernels + 72 views at every R; the dispatcher then applies the merged
    # placement once more). No loop over ranks or entries: a CUDA graph can capture it.
    counts = {ranks: top_up_ops(ranks) for ranks in (8, 64, 224)}
    assert len(set(counts.values())) == 1, counts
    kernels, _ = counts[64]
    assert kernels <= 500, counts


def test_top_ups_appear_only_where_the_placement_falls_short():
    """Under a placement planned from the same loads nothing is topped up (no weights would
    travel); with no placement and every token on one rank's experts, the top-ups bring every
    rank within its capacity, in the slots after the placement's."""
    ranks, replicas, experts, tokens, top_k = 8, 2, 64, 256, 4
    capacity = capacity_per_destination(tokens, top_k, ranks, 1.25)
    generator = torch.Generator().manual_seed(3)
    counts = torch.distributions.Multinomial(tokens * top_k, torch.rand(ranks, experts, generator=generator) + 0.5)
    counts = counts.sample().long()
    placement = ReplicaPlacement.from_plan(greedy_plan_from_load(counts.sum(0), ranks, replicas, 0.05))
    merged = top_up_placement(counts, placement, capacity, 2, 0.25)
    assert not merged.valid[ranks * replicas :].any()
    concentrated = torch.zeros(ranks, experts, dtype=torch.int64)
    concentrated[:, :top_k] = tokens  # every token of every source on experts 0 … k−1 (rank 0's)
    empty = ReplicaPlacement.empty(ranks, replicas)
    merged = top_up_placement(concentrated, empty, capacity, 2, 0.25)
    top_ups = merged.valid[ranks * replicas :]
    assert top_ups.any() and (merged.slot[ranks * replicas :][top_ups] >= replicas).all()
    plan = apply_placement(concentrated, merged, capacity)
    assert int(plan.rank_load.max()) <= capacity
