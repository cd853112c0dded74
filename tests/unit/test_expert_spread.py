"""The spread transport's arithmetic (parallel/expert_spread.py), every rank simulated in one
process: each slot's hop-1 row and its intermediate's hop-2 row must deliver it to its own
destination in a row of its own, for any pairs whose destinations are within capacity (no
drops), and slots beyond a destination's capacity must be the ones counted as dropped."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from k3train.parallel.expert_plan import pair_positions
from k3train.parallel.expert_spread import plan_spread, spread_capacity, spread_forward, spread_kept, spread_route


def random_pairs(ranks: int, slots: int, concentration: float, generator: torch.Generator) -> torch.Tensor:
    """`[R, R]` pairs with every row summing to `slots`: each source's slots over the
    destinations by a Dirichlet draw (small `concentration`: a few destinations take most)."""
    shares = torch.distributions.Dirichlet(torch.full((ranks,), concentration)).sample((ranks,))
    pairs = (shares * slots).floor().long()
    pairs[:, 0] += slots - pairs.sum(1)
    return pairs[:, torch.randperm(ranks, generator=generator)]


def deliver(pairs: torch.Tensor, capacity: int):
    """Route every slot of every source; returns (delivered {(d, hop-2 row at d): (s, slot)},
    kept per source, the plan)."""
    ranks, slots = pairs.shape[0], int(pairs[0].sum())
    cap = spread_capacity(slots, ranks, capacity)
    plan = plan_spread(pairs, cap)
    forwards = [spread_forward(plan, r) for r in range(ranks)]
    delivered, kept = {}, []
    for source in range(ranks):
        dest = torch.repeat_interleave(torch.arange(ranks), pairs[source])
        dest = dest[torch.randperm(slots, generator=torch.Generator().manual_seed(source))]
        weights = torch.rand(slots, generator=torch.Generator().manual_seed(100 + source))
        position = pair_positions(dest, weights, ranks)
        hop1 = spread_route(dest, position, source, plan)
        keep = spread_kept(dest, position, source, plan)
        kept.append(keep)
        assert int(hop1.max()) < ranks * cap.first and hop1.unique().numel() == slots
        for slot in range(slots):
            intermediate, row = divmod(int(hop1[slot]), cap.first)
            to_hop2, real = forwards[intermediate]
            target = int(to_hop2[source * cap.first + row])
            assert bool(real[source * cap.first + row]) == bool(keep[slot])
            if keep[slot]:
                destination, hop2_row = divmod(target, cap.second)
                assert destination == int(dest[slot])  # arrives where its expert is
                key = (intermediate, destination, hop2_row)
                assert key not in delivered  # a row of its own
                delivered[key] = (source, slot)
    return delivered, kept, plan


@pytest.mark.parametrize("ranks,concentration", [(4, 0.3), (5, 1.0), (8, 0.3)])
def test_spread_delivers_every_slot_within_capacity(ranks, concentration):
    generator = torch.Generator().manual_seed(ranks)
    torch.manual_seed(ranks)  # the Dirichlet draws
    slots = 96
    capacity = slots * 2  # destinations may take twice the even share
    checked = 0
    for _ in range(8):
        pairs = random_pairs(ranks, slots, concentration, generator)
        if int(pairs.sum(0).max()) > capacity:  # the replica planner keeps destinations within it
            continue
        delivered, kept, plan = deliver(pairs, capacity)
        assert len(delivered) == ranks * slots and all(bool(k.all()) for k in kept)
        assert int(plan.dropped.sum()) == 0
        assert int(pairs.max()) > slots // ranks * 2  # pairs far from even: a one-hop layout would overflow
        checked += 1
    assert checked >= 3


def test_spread_counts_what_a_destination_over_capacity_cannot_take():
    ranks, slots = 4, 64
    pairs = torch.zeros(ranks, ranks, dtype=torch.int64)
    pairs[:, 1] = slots  # every source sends everything to rank 1: 4× the even share
    capacity = 2 * slots
    delivered, kept, plan = deliver(pairs, capacity)
    dropped = sum(int((~k).sum()) for k in kept)
    assert dropped == int(plan.dropped.sum()) > 0
    assert len(delivered) == ranks * slots - dropped
    # hop 2 holds C2 rows per (intermediate, destination): what reaches rank 1 is at least C_dest
    assert len(delivered) >= capacity


class OpCounter(TorchDispatchMode):
    """Counts the tensor operations (kernel launches on a GPU) run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def spread_planning_ops(ranks: int) -> int:
    slots = 64
    generator = torch.Generator().manual_seed(ranks)
    pairs = random_pairs(ranks, slots, 1.0, generator)
    dest = torch.repeat_interleave(torch.arange(ranks), pairs[0])
    weights = torch.rand(slots, generator=generator)
    counter = OpCounter()
    with counter:
        cap = spread_capacity(slots, ranks, 2 * slots)
        plan = plan_spread(pairs, cap)
        position = pair_positions(dest, weights, ranks)
        spread_route(dest, position, 0, plan)
        spread_kept(dest, position, 0, plan)
        spread_forward(plan, 0)
    return counter.ops


def test_spread_planning_is_a_fixed_number_of_operations():
    # no loop over ranks or slots: the same operations (kernel launches) at every EP size
    counts = {ranks: spread_planning_ops(ranks) for ranks in (2, 4, 16)}
    assert len(set(counts.values())) == 1, counts
    assert counts[4] <= 120, counts


def test_the_gpu_default_transport_is_exact_where_split_sizes_stay_on_the_device():
    from k3train.parallel.expert import resolve_transport

    assert resolve_transport("auto", "nccl") == "exact"
    assert resolve_transport("auto", "nccl", device_splits=False) == "spread"
    assert resolve_transport("auto", "gloo") == "splits"
    assert resolve_transport("nodes", "gloo") == "nodes"
    assert resolve_transport("exact", "nccl") == "exact"
    with pytest.raises(ValueError):
        resolve_transport("one_sided", "nccl")
