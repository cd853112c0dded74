"""Expert-parallel planner, slot routing and drop policy in one process (parallel/expert.py).

Several EP ranks are simulated by calling the per-source functions once per source; the
multi-process equivalence runs are in tests/distributed/test_expert_parallel.py.
"""

from types import SimpleNamespace

import pytest
import torch

from k3train.checkpoint.values import decode_value, encode_value
from k3train.parallel.comm import Group, TrafficCounter
from k3train.parallel.expert import ExpertParallel
from k3train.parallel.expert_placement import ReplicaPlacement
from k3train.parallel.expert_plan import (
    RelayCapacity,
    apply_placement,
    capacity_per_destination,
    capacity_per_pair,
    destination_room,
    greedy_plan_from_load,
    home_route,
    pack_slots,
    pair_positions,
    pair_slots,
    plan_from_load,
    plan_relay,
    plan_replicas,
    proportional_pairs,
    proportional_route,
    proportional_shares,
    relay_capacity,
    relay_forward,
    relay_route,
    replica_route,
)
from tests.distributed.workers_expert import (
    reference_capacity_keep,
)


def single_group() -> Group:
    return Group("ep", (0,), 0, None, TrafficCounter())


def skewed_routing(sources: int, tokens: int, experts: int, top_k: int, skew: float, seed: int):
    """Per source: expert ids [tokens, k] (distinct per token) and weights, hot experts first."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(sources, tokens, experts, generator=generator) + skew * torch.linspace(1, -1, experts)
    weights, ids = logits.sigmoid().topk(top_k, dim=-1)
    return ids, weights


# ---------------------------------------------------------------------------- capacity and drop policy
def test_capacity_is_a_function_of_config_and_micro_batch():
    assert capacity_per_pair(tokens=64, top_k=4, ep=2, capacity_factor=1.25) == 160
    assert capacity_per_pair(tokens=64, top_k=4, ep=4, capacity_factor=4.0) == 256  # = s·k: never drops
    assert capacity_per_pair(tokens=64, top_k=4, ep=4, capacity_factor=100.0) == 256  # capped at s·k
    assert capacity_per_pair(tokens=3, top_k=1, ep=8, capacity_factor=0.1) == 1
    expert_parallel = ExpertParallel(SimpleNamespace(size=4, rank=1), 16, "balanced", 1.25, max_replicas_per_rank=2)
    # balanced, relay transport (the default): hop 1 [R, direct + relay], hop 2 [R, second], summing
    # to ceil(1.25 · s·k/R) = 80 rows per pair
    assert relay_capacity(64, 4, 4, 1.25) == RelayCapacity(first=72, second=8)
    assert expert_parallel.buffer_shapes(tokens=64, top_k=4, latent=32, inner=48) == {
        "dispatch": (4, 72, 32),
        "dispatch_ids": (4, 72),
        "forward": (4, 8, 32),
        "forward_ids": (4, 8),
        "combine_forwarded": (4, 8, 32),
        "combine": (4, 72, 32),
        "received": (320, 32),
        "slot_counts": (4, 16),
        "replica_weights": (4, 2, 3 * 48 * 32),  # online: [R, M, F] per micro-batch
    }
    padded = ExpertParallel(SimpleNamespace(size=4, rank=1), 16, "balanced", 1.25, 2, transport="padded")
    shapes = padded.buffer_shapes(tokens=64, top_k=4, latent=32, inner=48)
    # balanced: per-pair send rows of the padded transport, one [C_dest] receive buffer
    assert capacity_per_destination(64, 4, 4, 1.25) == 320 == expert_parallel.capacity(64, 4)
    assert shapes == {
        "dispatch": (4, 256, 32),
        "dispatch_ids": (4, 256),
        "combine": (4, 256, 32),
        "received": (320, 32),
        "slot_counts": (4, 16),
        "replica_weights": (4, 2, 3 * 48 * 32),  # online: [R, M, F] per micro-batch
    }
    spread = ExpertParallel(SimpleNamespace(size=4, rank=1), 16, "balanced", 1.25, 2, transport="spread")
    # spread: hop 1 ceil(s·k/R) = 64 rows per pair, hop 2 ceil(C_dest/R) + R = 84
    assert spread.buffer_shapes(tokens=64, top_k=4, latent=32, inner=48)["dispatch"] == (4, 64, 32)
    assert spread.buffer_shapes(tokens=64, top_k=4, latent=32, inner=48)["forward"] == (4, 84, 32)
    step = ExpertParallel(SimpleNamespace(size=4, rank=1), 16, "balanced", 1.25, 2, replica_planning="step")
    assert step.buffer_shapes(tokens=64, top_k=4, latent=32, inner=48)["replica_weights"] == (2, 3 * 48 * 32)
    capacity_mode = ExpertParallel(SimpleNamespace(size=4, rank=1), 16, "capacity", 1.25)
    assert capacity_mode.buffer_shapes(tokens=64, top_k=4, latent=32, inner=48) == {
        "dispatch": (4, 80, 32),
        "dispatch_ids": (4, 80),
        "combine": (4, 80, 32),
    }
    assert capacity_per_destination(64, 4, 4, 100.0) == 4 * 256  # capped at everything the group routes


@pytest.mark.parametrize("ranks,capacity", [(1, 5), (2, 7), (4, 3), (4, 64), (8, 1)])
def test_drop_policy_keeps_highest_weights_per_destination(ranks, capacity):
    experts, top_k, tokens = 16, 4, 40
    ids, weights = skewed_routing(1, tokens, experts, top_k, skew=2.0, seed=ranks * 10 + capacity)
    ids, weights = ids[0], weights[0]
    weights = (weights * 8).round() / 8  # many ties: broken by slot index
    dest, _ = home_route(ids.reshape(-1), experts // ranks)
    buffer_index, keep = pack_slots(dest, weights.reshape(-1), ranks, capacity)
    expected = reference_capacity_keep(ids, weights, ranks, experts // ranks, capacity)
    assert torch.equal(keep.view(tokens, top_k), expected)
    kept = buffer_index[keep]
    assert kept.unique().numel() == kept.numel()  # one slot per buffer row
    assert torch.all(kept // capacity == dest[keep]) and torch.all(buffer_index[~keep] == ranks * capacity)


# ---------------------------------------------------------------------------- planner
def test_planner_leaves_balanced_routing_alone():
    counts = torch.full((4, 16), 10, dtype=torch.int64)
    plan = plan_replicas(counts, max_replicas_per_rank=2)
    assert not plan.valid.any() and torch.equal(plan.rank_load, torch.full((4,), 160))


@pytest.mark.parametrize("ranks,replicas,skew", [(2, 2, 1.0), (4, 2, 2.0), (4, 1, 4.0), (8, 2, 3.0), (8, 3, 1.0)])
def test_planner_invariants(ranks, replicas, skew):
    experts, top_k, tokens = 32, 4, 64
    ids, _ = skewed_routing(ranks, tokens, experts, top_k, skew, seed=ranks)
    counts = torch.stack([torch.bincount(ids[r].flatten(), minlength=experts) for r in range(ranks)])
    plan = plan_replicas(counts, replicas)
    local = experts // ranks
    valid = plan.valid
    # each rank hosts at most `replicas`, never a replica of its own expert, slots 0..used-1
    for rank in range(ranks):
        slots = plan.slot[valid & (plan.dest == rank)]
        assert slots.numel() <= replicas and sorted(slots.tolist()) == list(range(slots.numel()))
    assert torch.all(plan.expert[valid] // local != plan.dest[valid])
    # every expert's slots are split exactly between its home and its replicas, as intervals
    held = plan.home.clone().index_add_(0, plan.expert[valid], plan.amount[valid])
    assert torch.equal(held, plan.load)
    for e in plan.expert[valid].unique().tolist():
        entries = (valid & (plan.expert == e)).nonzero().flatten().tolist()
        position = int(plan.home[e])
        for j in entries:
            assert int(plan.start[j]) == position
            position += int(plan.amount[j])
    # planned rank loads are what the plan says, and never worse than before
    rank_load = plan.home.view(ranks, local).sum(1).index_add_(0, plan.dest[valid], plan.amount[valid])
    assert torch.equal(rank_load, plan.rank_load)
    target = tokens * top_k
    before = counts.sum(0).view(ranks, local).sum(1)
    assert plan.rank_load.max() <= max(before.max(), target) and plan.rank_load.max() <= before.max()
    assert torch.equal(plan_replicas(counts, replicas).expert, plan.expert)  # deterministic


def test_planner_balances_exactly_when_replica_slots_suffice():
    # rank 0 has two hot experts (share 300 each); ranks 1..3 are light: 3 replicas are enough
    counts = torch.full((4, 16), 0, dtype=torch.int64)
    load = torch.tensor([300, 300, 20, 20] + [60] * 12)
    counts[:] = load // 4
    plan = plan_replicas(counts, max_replicas_per_rank=1)
    target = int(counts.sum()) // 4
    assert int(plan.rank_load.max()) == target == int(plan.rank_load.min())


# ---------------------------------------------------------------------------- slot routing
@pytest.mark.parametrize("ranks,replicas", [(2, 2), (4, 2), (8, 1)])
def test_replica_route_follows_the_plan_exactly(ranks, replicas):
    experts, top_k, tokens = 32, 4, 64
    local = experts // ranks
    ids, weights = skewed_routing(ranks, tokens, experts, top_k, 2.5, seed=5 + ranks)
    counts = torch.stack([torch.bincount(ids[r].flatten(), minlength=experts) for r in range(ranks)])
    plan = plan_replicas(counts, replicas)
    assert plan.valid.any()
    received = torch.zeros(ranks, local + replicas, dtype=torch.int64)  # per destination and local id
    pair = torch.zeros(ranks, ranks, dtype=torch.int64)
    for source in range(ranks):
        flat = ids[source].flatten()
        dest, local_id = replica_route(flat, counts, source, plan)
        home = flat // local
        at_home = dest == home
        assert torch.all(local_id[at_home] == flat[at_home] % local)
        # a slot away from home goes to a valid replica of its own expert
        for slot in (~at_home).nonzero().flatten().tolist():
            entry = ((plan.dest == dest[slot]) & (plan.slot == local_id[slot] - local) & plan.valid).nonzero()
            assert entry.numel() == 1 and int(plan.expert[entry]) == int(flat[slot])
        received.index_put_((dest, local_id), torch.ones_like(dest), accumulate=True)
        pair[source] = torch.bincount(dest, minlength=ranks)
        # with C = s·k nothing is dropped
        _, keep = pack_slots(dest, weights[source].flatten(), ranks, tokens * top_k)
        assert keep.all()
    # each holder receives exactly its planned share, and every rank knows every pair
    assert torch.equal(received[:, :local], plan.home.view(ranks, local))
    for j in plan.valid.nonzero().flatten().tolist():
        assert int(received[plan.dest[j], local + plan.slot[j]]) == int(plan.amount[j])
    assert torch.equal(received.sum(1), pair.sum(0)) and torch.equal(received.sum(1), plan.rank_load)
    assert torch.equal(pair_slots(counts, plan), pair)


def balanced_drops(ids, weights, counts, plan, capacity) -> int:
    ranks = counts.shape[0]
    room = destination_room(pair_slots(counts, plan), capacity)
    dropped = 0
    for source in range(ranks):
        dest, _ = replica_route(ids[source].flatten(), counts, source, plan)
        _, keep = pack_slots(dest, weights[source].flatten(), ranks, room[source])
        assert int(keep.sum()) == int(room[source].sum())  # what the receivers expect, exactly
        dropped += int((~keep).sum())
    return dropped


def test_balanced_mode_drops_nothing_where_capacity_mode_drops():
    ranks, experts, top_k, tokens, replicas = 8, 64, 4, 128, 2
    ids, weights = skewed_routing(ranks, tokens, experts, top_k, 3.0, seed=1)
    counts = torch.stack([torch.bincount(ids[r].flatten(), minlength=experts) for r in range(ranks)])
    capacity = capacity_per_pair(tokens, top_k, ranks, 1.25)
    plan = plan_replicas(counts, replicas)
    dropped_capacity = sum(
        int(
            (
                ~pack_slots(home_route(ids[s].flatten(), experts // ranks)[0], weights[s].flatten(), ranks, capacity)[1]
            ).sum()
        )
        for s in range(ranks)
    )
    assert dropped_capacity > 0
    assert int(plan.rank_load.max()) <= capacity_per_destination(tokens, top_k, ranks, 1.25)
    assert balanced_drops(ids, weights, counts, plan, capacity_per_destination(tokens, top_k, ranks, 1.25)) == 0


def per_source_skewed_counts(ranks, tokens, experts, top_k, hot, boost, seed):
    """Each source has its own `hot` experts, all on one home rank (the worst case for pairs)."""
    generator = torch.Generator().manual_seed(seed)
    local = experts // ranks
    ids, weights = [], []
    for source in range(ranks):
        logits = torch.randn(tokens, experts, generator=generator)
        home = (source * 3 + 1) % ranks
        logits[:, home * local : home * local + hot] += boost
        w, i = logits.sigmoid().topk(top_k, dim=-1)
        ids.append(i)
        weights.append(w)
    ids, weights = torch.stack(ids), torch.stack(weights)
    counts = torch.stack([torch.bincount(ids[r].flatten(), minlength=experts) for r in range(ranks)])
    return ids, weights, counts


def test_per_source_skew_overflows_pairs_but_not_destinations():
    """Per-source hot experts overflow the (source, destination) pairs of the old layout even
    with replicas; the per-destination layout only needs the destinations' totals."""
    ranks, experts, top_k, tokens = 8, 64, 4, 128
    ids, weights, counts = per_source_skewed_counts(ranks, tokens, experts, top_k, hot=3, boost=2.0, seed=4)
    pair_capacity = capacity_per_pair(tokens, top_k, ranks, 1.25)
    plan = plan_replicas(counts, 2)
    home_pairs = torch.stack(
        [torch.bincount(home_route(ids[s].flatten(), experts // ranks)[0], minlength=ranks) for s in range(ranks)]
    )
    assert int(home_pairs.max()) > 2 * pair_capacity  # a source sends a hot rank far over its pair share
    assert balanced_drops(ids, weights, counts, plan, capacity_per_destination(tokens, top_k, ranks, 1.25)) == 0


def test_step_placement_from_previous_loads():
    """The placement planned on one step's loads, applied to the next step's counts: each replica
    takes its share of the expert's current load, intervals tile the load, and it still balances."""
    ranks, experts, top_k, tokens = 8, 64, 4, 128
    before, _ = skewed_routing(ranks, tokens, experts, top_k, 3.0, seed=1)
    now, weights = skewed_routing(ranks, tokens, experts, top_k, 3.0, seed=2)
    load_before = torch.bincount(before.flatten(), minlength=experts)
    placement = ReplicaPlacement.from_plan(greedy_plan_from_load(load_before, ranks, 2, tolerance=0.05))
    assert placement.num_replicas > 0 and len(placement.host) == int(placement.valid.sum())
    counts = torch.stack([torch.bincount(now[r].flatten(), minlength=experts) for r in range(ranks)])
    plan = apply_placement(counts, placement)
    held = plan.home.clone().index_add_(0, plan.expert[plan.valid], plan.amount[plan.valid])
    assert torch.equal(held, plan.load) and torch.all(plan.home >= 0)
    home_load = counts.sum(0).view(ranks, -1).sum(1)
    assert int(plan.rank_load.max()) < 0.8 * int(home_load.max())
    assert balanced_drops(now, weights, counts, plan, capacity_per_destination(tokens, top_k, ranks, 1.25)) == 0
    empty = apply_placement(counts, ReplicaPlacement.empty(ranks, 2))
    assert torch.equal(empty.rank_load, home_load) and not empty.valid.any()


def sequential_placement_loads(counts, placement, capacity):
    """Plain Python: the greedy pass entry by entry (the loop `apply_placement` replaces)."""
    ranks, experts = counts.shape
    local = experts // ranks
    load = counts.sum(0).tolist()
    home = list(load)
    rank_load = [sum(load[r * local : (r + 1) * local]) for r in range(ranks)]
    target = sum(load) // ranks
    entries = [(int(e), int(d)) for e, d, v in zip(placement.expert, placement.dest, placement.valid) if v]
    for level in (target, capacity):
        for expert, dest in entries:
            owner = expert // local
            move = max(0, min(rank_load[owner] - level, level - rank_load[dest], home[expert]))
            home[expert] -= move
            rank_load[owner] -= move
            rank_load[dest] += move
    return rank_load


@pytest.mark.parametrize("ranks,skew,seed", [(4, 2.0, 1), (8, 3.0, 2), (16, 1.0, 3), (8, 0.3, 4)])
def test_vectorised_placement_matches_the_sequential_greedy(ranks, skew, seed):
    experts, top_k, tokens = 4 * ranks, 4, 128
    before, _ = skewed_routing(ranks, tokens, experts, top_k, skew, seed=seed)
    now, _ = skewed_routing(ranks, tokens, experts, top_k, skew, seed=seed + 100)
    load_before = torch.bincount(before.flatten(), minlength=experts)
    first = greedy_plan_from_load(load_before, ranks, 2, tolerance=0.05)
    placement = ReplicaPlacement.from_plan(first).with_spares(load_before, first.rank_load, 2)
    counts = torch.stack([torch.bincount(now[r].flatten(), minlength=experts) for r in range(ranks)])
    capacity = capacity_per_destination(tokens, top_k, ranks, 1.25)
    plan = apply_placement(counts, placement, capacity)
    held = plan.home.clone().index_add_(0, plan.expert[plan.valid], plan.amount[plan.valid])
    assert torch.equal(held, plan.load) and torch.all(plan.home >= 0) and torch.all(plan.amount >= 0)
    home_load = counts.sum(0).view(ranks, -1).sum(1)
    assert int(plan.rank_load.sum()) == int(counts.sum())
    # receivers never go above the capacity, givers never below the even share
    assert int(plan.rank_load.max()) <= max(capacity, int(home_load.max()))
    assert int(plan.rank_load.max()) == max(sequential_placement_loads(counts, placement, capacity))


def test_tolerance_leaves_nearly_even_loads_alone():
    load = torch.full((32,), 100, dtype=torch.int64)
    load[0] += 30  # rank 0 at 1.0075 of the mean
    assert not plan_from_load(load, 4, 2, tolerance=0.05).valid.any()
    assert plan_from_load(load, 4, 2, tolerance=0.0).valid.any()


# ---------------------------------------------------------------------------- relay transport
def step_plan(ids, counts, ranks, experts, top_k, tokens, replicas=2):
    """A placement planned on these loads, applied to them (as the next step would)."""
    load = counts.sum(0)
    first = greedy_plan_from_load(load, ranks, replicas, 0.05)
    placement = ReplicaPlacement.from_plan(first).with_spares(load, first.rank_load, replicas)
    return apply_placement(counts, placement, capacity_per_destination(tokens, top_k, ranks, 1.25)), placement


def simulate_relay(ids, weights, counts, plan, capacity):
    """Move slot identities through both hops as the dispatcher does, for every simulated rank;
    returns {destination: [(source, slot, local id)]} and the slots kept."""
    ranks, tokens, top_k = ids.shape
    slots = tokens * top_k
    shares = proportional_shares(counts, plan)
    pairs = proportional_pairs(counts, plan, shares)
    relay_plan = plan_relay(pairs, capacity)
    hop1 = torch.full((ranks, ranks * capacity.first + 1), -1, dtype=torch.int64)
    local_ids, kept = [], 0
    for source in range(ranks):
        dest, local_id = proportional_route(ids[source].flatten(), counts, source, plan, shares)
        assert torch.equal(torch.bincount(dest, minlength=ranks), pairs[source])
        index, keep = relay_route(dest, pair_positions(dest, weights[source].flatten(), ranks), source, relay_plan)
        assert index[keep].unique().numel() == int(keep.sum()) and bool((index[keep] < ranks * capacity.first).all())
        hop1[source].index_copy_(0, index, torch.where(keep, source * slots + torch.arange(slots), -1))
        local_ids.append(local_id)
        kept += int(keep.sum())
    assert kept == int(counts.sum() - relay_plan.dropped.sum())
    received = hop1[:, :-1].view(ranks, ranks, capacity.first).transpose(0, 1).reshape(ranks, -1)
    hop2 = torch.full((ranks, ranks * capacity.second + 1), -1, dtype=torch.int64)
    arrived = {d: [] for d in range(ranks)}
    for relay in range(ranks):
        to_hop2, direct = relay_forward(relay_plan, relay)
        rows = received[relay]
        arrived[relay].append(rows[direct & (rows >= 0)])
        relayed = ~direct & (rows >= 0)
        assert bool((to_hop2[relayed] < ranks * capacity.second).all()), "a relayed row without a hop-2 row"
        assert to_hop2[relayed].unique().numel() == int(relayed.sum())
        hop2[relay].scatter_(0, to_hop2[relayed], rows[relayed])
    forwarded = hop2[:, :-1].view(ranks, ranks, capacity.second).transpose(0, 1).reshape(ranks, -1)
    delivered = {}
    for d in range(ranks):
        rows = torch.cat(arrived[d] + [forwarded[d]])
        rows = rows[rows >= 0]
        delivered[d] = [
            (int(r) // slots, int(r) % slots, int(local_ids[int(r) // slots][int(r) % slots])) for r in rows
        ]
    return delivered, kept, relay_plan


@pytest.mark.parametrize("ranks,skew,hot_boost", [(4, 2.0, 0.0), (8, 0.5, 2.0), (8, 3.0, 0.0), (16, 1.0, 3.0)])
def test_relay_delivers_each_kept_slot_once_to_a_holder_of_its_expert(ranks, skew, hot_boost):
    experts, top_k, tokens = 4 * ranks, 4, 64
    if hot_boost:
        ids, weights, counts = per_source_skewed_counts(
            ranks, tokens, experts, top_k, hot=2, boost=hot_boost, seed=ranks
        )
    else:
        ids, weights = skewed_routing(ranks, tokens, experts, top_k, skew, seed=ranks)
        counts = torch.stack([torch.bincount(ids[r].flatten(), minlength=experts) for r in range(ranks)])
    plan, placement = step_plan(ids, counts, ranks, experts, top_k, tokens)
    capacity = relay_capacity(tokens, top_k, ranks, 1.25)
    delivered, kept, relay_plan = simulate_relay(ids, weights, counts, plan, capacity)
    assert sum(len(rows) for rows in delivered.values()) == kept
    local = experts // ranks
    hosted = {(dest, local + slot): expert for expert, dest, slot in placement.host}
    for d, rows in delivered.items():
        for source, slot, local_id in rows:
            expert = int(ids[source].flatten()[slot])
            assert (d * local + local_id == expert) if local_id < local else hosted[(d, local_id)] == expert
    # the bounds the plan enforces hold for the real loads of every hop
    assert int(relay_plan.direct.max()) <= capacity.first
    hop2 = relay_plan.room.sum(0)  # [r, d]
    assert int(hop2.max()) <= capacity.second and torch.all(relay_plan.room <= relay_plan.counts)
    assert torch.equal(relay_plan.counts.sum(1), relay_plan.overflow)  # every overflow row has a relay
    assert capacity.rows * ranks <= 1.25 * tokens * top_k + ranks


def test_proportional_shares_keep_the_planned_loads_and_flatten_pairs():
    """Splitting each source's slots of a replicated expert over its holders: every holder gets
    its planned amount, and the largest pair drops well below the contiguous routing's."""
    ranks, experts, top_k, tokens = 4, 16, 4, 256
    ids, weights = skewed_routing(ranks, tokens, experts, top_k, 2.0, seed=1)
    counts = torch.stack([torch.bincount(ids[r].flatten(), minlength=experts) for r in range(ranks)])
    plan, _ = step_plan(ids, counts, ranks, experts, top_k, tokens)
    shares = proportional_shares(counts, plan)
    assert torch.all(shares[0] >= 0) and torch.all(shares[1] >= 0)
    assert torch.equal(shares[0].sum(1) + shares[1].sum(1), counts.sum(1))
    pairs = proportional_pairs(counts, plan, shares)
    assert torch.equal(pairs.sum(0), plan.rank_load)  # destinations exactly as planned
    contiguous = pair_slots(counts, plan)
    assert int(pairs.max()) < 0.8 * int(contiguous.max())


def test_relay_drops_only_beyond_its_bounds_and_counts_them():
    """Adversarial routing (every source sends everything to one rank, no replicas): the plan
    drops, the drop count is what the sources drop, and each hop's bound holds."""
    ranks, experts, top_k, tokens = 4, 16, 2, 32
    ids = torch.randint(0, 4, (ranks, tokens, top_k))  # rank 0's experts only
    ids[..., 1] = (ids[..., 0] + 1) % 4
    weights = torch.rand(ranks, tokens, top_k)
    counts = torch.stack([torch.bincount(ids[r].flatten(), minlength=experts) for r in range(ranks)])
    plan = apply_placement(counts, ReplicaPlacement.empty(ranks, 2))
    capacity = relay_capacity(tokens, top_k, ranks, 1.25)
    delivered, kept, relay_plan = simulate_relay(ids, weights, counts, plan, capacity)
    assert int(relay_plan.dropped.sum()) == int(counts.sum()) - kept > 0
    # rank 0 receives all it can: every hop-1 pair into it, and hop 2 from the other ranks (its own
    # hop-1 rows from others are all direct, so it relays nothing to itself)
    assert kept == capacity.first * ranks + capacity.second * (ranks - 1)


# ---------------------------------------------------------------------------- checkpoints
def test_replica_placement_round_trips_through_checkpoint_values():
    """The placement `finish_step` planned is saved as JSON values and restored into a fresh
    dispatcher (before any layer ran), so the resumed step hosts the same replicas."""
    group = SimpleNamespace(size=4, rank=1, name="ep")
    experts_modules = [
        SimpleNamespace(
            w1=torch.nn.Parameter(torch.zeros(4, 2, 2)),
            w3=torch.nn.Parameter(torch.zeros(4, 2, 2)),
            w2=torch.nn.Parameter(torch.zeros(4, 2, 2)),
        )
        for _ in range(2)
    ]
    saving = ExpertParallel(group, 16, "balanced", 1.25, 2, replica_planning="step")
    for module in experts_modules:
        saving.mark_expert_params(module)
    load = torch.arange(16, dtype=torch.int64) ** 2
    for module in experts_modules:
        layer = saving._layer(module)
        layer.load += load
    saving.spare_replicas = True
    saving.finish_step()  # plans the next step's placement from the loads
    placements = [saving._layer(module).placement.host for module in experts_modules]
    assert all(placements)
    state = decode_value(encode_value(saving.state_dict()))  # what the checkpoint files hold
    restoring = ExpertParallel(group, 16, "balanced", 1.25, 2, replica_planning="step")
    for module in experts_modules:
        restoring.mark_expert_params(module)
    restoring.load_state_dict(state)
    assert [restoring._layer(module).placement.host for module in experts_modules] == placements
    assert torch.equal(
        restoring._layer(experts_modules[0]).placement.dest, saving._layer(experts_modules[0]).placement.dest
    )
    other = ExpertParallel(SimpleNamespace(size=2, rank=1, name="ep"), 16, "balanced", 1.25, 2)
    with pytest.warns(UserWarning, match="ep=4"):
        other.load_state_dict(state)  # another layout: starts without replicas


# ---------------------------------------------------------------------------- the layer in one process
