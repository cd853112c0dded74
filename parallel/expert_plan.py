"""Expert-parallel planning on the device: replica placement, slot routing and the drop rules.

Pure tensor functions, no communication: every rank of the EP group calls them on the same
all-gathered slot counts and gets the same answer, so nothing here is sent or read on the host.
`parallel/expert.py` runs them inside the dispatch; `benchmarks/ep_scale.py` runs them for
hundreds of simulated ranks in one process. Layout and formulas: docs/expert_parallel.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from k3train.parallel.expert_placement import ReplicaPlacement


def capacity_per_pair(tokens: int, top_k: int, ep: int, capacity_factor: float) -> int:
    """`capacity` mode: `C_pair = min(s·k, ceil(capacity_factor · s·k / R))`, at least 1: a
    function of the config and the micro-batch size only."""
    slots = tokens * top_k
    return max(1, min(slots, math.ceil(capacity_factor * slots / ep)))


def capacity_per_destination(tokens: int, top_k: int, ep: int, capacity_factor: float) -> int:
    """`balanced` mode: rows one destination receives, `C_dest = min(R·s·k, ceil(capacity_factor · s·k))`
    (the even share `s·k` per destination, times the factor). The only capacity of the layout."""
    slots = tokens * top_k
    return max(1, min(ep * slots, math.ceil(capacity_factor * slots)))


# ---------------------------------------------------------------------------------------------
# Replica plans


@dataclass
class ReplicaPlan:
    """Replica placements for one layer and micro-batch, identical on every rank of the EP group.

    `N = R·M` entries; entry `j` (if `valid[j]`) hosts expert `expert[j]` on rank `dest[j]` in
    replica slot `slot[j]`, holding positions `[start[j], start[j] + amount[j])` of the expert's
    slot interval `[0, load[e])` (the home rank holds `[0, home[e])`). All tensors, fixed shapes.
    """

    expert: torch.Tensor  # [N] int64
    dest: torch.Tensor  # [N] int64
    slot: torch.Tensor  # [N] int64
    start: torch.Tensor  # [N] int64
    amount: torch.Tensor  # [N] int64
    valid: torch.Tensor  # [N] bool
    load: torch.Tensor  # [E] int64, slots routed to each expert over the EP group
    home: torch.Tensor  # [E] int64, slots left on the home rank
    rank_load: torch.Tensor  # [R] int64, planned slots per rank

    @property
    def num_replicas(self) -> torch.Tensor:
        return self.valid.sum()


def _at(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`tensor[index]` for a 0-dim index tensor without reading it on the host."""
    return tensor.index_select(0, index.view(1)).squeeze(0)


def _finish_plan(expert, dest, amount, load, home, rank_load) -> ReplicaPlan:
    """Replica slots on each destination and each entry's interval start, from the entries in
    order (a later entry of the same expert continues where the earlier one ended)."""
    entries = expert.shape[0]
    valid = amount > 0
    earlier = torch.ones(entries, entries, dtype=torch.bool, device=expert.device).tril(-1)  # [j, j'] j' < j
    slot = (earlier & (dest[:, None] == dest[None, :]) & valid[None, :]).sum(1)
    same_expert_before = earlier & (expert[:, None] == expert[None, :]) & valid[None, :]
    start = home[expert] + (same_expert_before.long() * amount[None, :]).sum(1)
    return ReplicaPlan(expert, dest, slot, start, amount, valid, load, home, rank_load)


def plan_replicas(counts: torch.Tensor, max_replicas_per_rank: int, tolerance: float = 0.0) -> ReplicaPlan:
    """Greedy, deterministic replica planner on the device. `counts [R, E]`: slots each source
    routes to each expert (or `[1, E]` loads with `num_ranks` given through `plan_from_load`).
    Runs `R·M` fixed iterations of small tensor ops; an iteration that finds nothing to move
    records an invalid entry. A rank is relieved only while it is above `(1 + tolerance)` times
    the even share, and then down to the even share."""
    return plan_from_load(counts.sum(0), counts.shape[0], max_replicas_per_rank, tolerance)


def plan_from_load(
    load: torch.Tensor,
    num_ranks: int,
    max_replicas_per_rank: int,
    tolerance: float = 0.0,
    extra_load: torch.Tensor | None = None,
) -> ReplicaPlan:
    """`plan_replicas` on the per-expert loads `[E]` of an EP group of `num_ranks`, in a fixed
    number of tensor operations whatever `R` (no loop; a merge of two cumulative sums).

    A rank above `(1 + tolerance)` times the even share gives its surplus down to the even share;
    a rank below it takes up to its deficit. Lay the surplus on a line, givers by surplus
    (largest first, ties: lower rank), within a giver its home experts by load (hottest first,
    ties: lower id), each expert a piece of at most its load, until the giver's surplus is
    covered; lay the deficits on another line, receivers by deficit (largest first, ties: lower
    rank). Receiver `d`'s interval of the deficit line takes the first `M` pieces it overlaps
    (its replica slots `0 … M − 1`): entry `(d, j)` hosts the `j`-th. What a receiver's `M`
    slots cannot take stays home. Givers and receivers are disjoint, so no rank hosts a replica
    of its own expert, and one expert has at most one replica per rank. This is the order the
    former greedy (`R·M` iterations: the most loaded rank's hottest remaining expert to the
    least loaded rank with a free slot) moved slots in while the ranks' order does not change;
    it differs where the greedy re-ranks (a receiver left partly filled by a small piece, two
    givers of nearly equal surplus), and `tests/unit/test_expert_plan.py` holds the two to the
    same per-destination capacity on random routings.

    `extra_load [R]`: slots each rank already holds besides its home shares (the replicas of a
    step placement, when this plan tops them up): counted in its load and the even share, never
    given away."""
    num_experts = load.shape[0]
    local, slots = num_experts // num_ranks, max_replicas_per_rank
    device = load.device
    load = load.long()
    shares = load.view(num_ranks, local)
    extra = torch.zeros(num_ranks, dtype=torch.int64, device=device) if extra_load is None else extra_load.long()
    rank_load = shares.sum(1) + extra
    excess = rank_load - (load.sum() + extra.sum()) // num_ranks  # over the even share
    # relieved only above (1 + tolerance)·target (for integer loads the same as above its floor)
    above = excess.clamp(min=0)
    deficit = above - excess
    surplus = above if tolerance == 0 else above * (excess > (rank_load - excess)[0].double() * tolerance)
    # each giver's hottest home experts, as many as cover its surplus (the last one cut): its pieces
    hottest, order = torch.sort(shares, dim=1, descending=True, stable=True)
    piece = (surplus[:, None] - hottest.cumsum(1) + hottest).clamp(min=torch.zeros_like(hottest), max=hottest)
    # the surplus line: every giver's pieces, largest first (ties: lower rank, hotter expert)
    piece, line = torch.sort(piece.view(-1), descending=True, stable=True)
    piece_expert = torch.div(line, local, rounding_mode="floor") * local + order.view(-1)[line]
    # receivers largest deficit first
    taken, receivers = torch.sort(deficit, descending=True, stable=True)
    # Each receiver's interval of the deficit line takes, of the first `M + 1` pieces it overlaps,
    # the `M` largest overlaps (so a slot is not spent on the remnant of a piece the previous
    # receiver took most of). Past the surplus's end every overlap is empty (at least one rank
    # gives nothing, so the line ends in empty pieces).
    piece_end = piece.cumsum(0)
    taken_end = taken.cumsum(0)[:, None]
    taken_start = taken_end - taken[:, None]
    candidates = torch.arange(slots + 1, device=device)
    index = (torch.searchsorted(piece_end, taken_start, right=True) + candidates).clamp(max=num_experts - 1)
    overlap = (
        torch.minimum(piece_end[index], taken_end) - torch.maximum((piece_end - piece)[index], taken_start)
    ).clamp(min=0)
    kept = candidates[:slots]
    kept = kept + (kept >= overlap.argmin(1, keepdim=True))  # all but the first smallest, in order
    # entry (receiver k, j): rank receivers[k], slot j (its first overlap is never empty, so a
    # receiver's non-empty entries come first)
    expert = piece_expert[index.gather(1, kept)].view(-1)
    amount = overlap.gather(1, kept).view(-1)
    slot = candidates[:slots].repeat(num_ranks)
    dest = receivers[:, None].repeat(1, slots).view(-1)
    home = load.index_add(0, expert, amount, alpha=-1)
    rank_load = (home.view(num_ranks, local).sum(1) + extra).index_add(0, dest, amount)
    # an expert's replica intervals follow its home share, in entry order
    start = home[expert] + ((expert[:, None] == expert).tril(-1) * amount).sum(1)
    valid = amount > 0
    return ReplicaPlan(expert, dest, slot, start, amount, valid, load, home, rank_load)


def greedy_plan_from_load(
    load: torch.Tensor, num_ranks: int, max_replicas_per_rank: int, tolerance: float = 0.0
) -> ReplicaPlan:
    """A step's replica placement from the previous step's loads: `R·M` iterations, each moving
    from the most loaded rank (first of them) its hottest remaining home share to the least
    loaded rank with a free replica slot (not the source), at most down (up) to the even share; a
    rank is relieved only while above `(1 + tolerance)` times the even share. On the device, no
    host read; once per step and layer (`finish_step`), where its `R·M` iterations re-rank the
    ranks after every move, which spreads a step's replicas over more distinct experts than
    `plan_from_load` (the per-dispatch plan, a fixed number of operations) does: what the next
    step's loads, which differ, need (`tests/unit/test_expert_plan.py`)."""
    num_experts = load.shape[0]
    local = num_experts // num_ranks
    entries = num_ranks * max_replicas_per_rank
    device = load.device
    load = load.long()
    home = load.clone()
    rank_load = load.view(num_ranks, local).sum(1)
    target = load.sum() // num_ranks  # the even share
    threshold = (target.double() * (1.0 + tolerance)).floor().long()
    used = torch.zeros(num_ranks, dtype=torch.int64, device=device)
    ranks = torch.arange(num_ranks, device=device)
    lowest = torch.iinfo(torch.int64).min
    experts, dests, amounts = [], [], []
    for _ in range(entries):
        surplus = rank_load - target
        source = surplus.argmax()  # first of the most loaded ranks
        home_shares = _at(home.view(num_ranks, local), source)
        expert = source * local + home_shares.argmax()  # its hottest remaining home share
        deficit = target - rank_load
        eligible = (used < max_replicas_per_rank) & (ranks != source)
        dest = torch.where(eligible, deficit, lowest).argmax()
        amount = torch.minimum(torch.minimum(_at(surplus, source), _at(deficit, dest)), _at(home, expert)).clamp(min=0)
        relieve = _at(eligible, dest) & (_at(rank_load, source) > threshold)
        amount = torch.where(relieve, amount, 0)
        home = home.index_add(0, expert.view(1), -amount.view(1))
        rank_load = rank_load.index_add(0, torch.stack([source, dest]), torch.stack([-amount, amount]))
        used = used.index_add(0, dest.view(1), (amount > 0).long().view(1))
        experts.append(expert)
        dests.append(dest)
        amounts.append(amount)
    empty = torch.zeros(0, dtype=torch.int64, device=device)
    expert = torch.stack(experts) if experts else empty
    dest = torch.stack(dests) if dests else empty
    amount = torch.stack(amounts) if amounts else empty
    return _finish_plan(expert, dest, amount, load, home, rank_load)


def _capped_in_order(
    want: torch.Tensor, group: torch.Tensor, room: torch.Tensor, earlier: torch.Tensor
) -> torch.Tensor:
    """`want [N]` reduced so that, in entry order, each group's running total stays within its
    `room` (`group [N]` the entry's group, `room` indexed by group; `earlier [N, N]` float
    `[j, j'] = j' < j`): `min(want_j, room − Σ_{earlier j' of the group} want_j')⁺`."""
    same = earlier * (group[:, None] == group[None, :])
    before = (same @ want.double()).long()
    return torch.minimum(want, (room[group] - before).clamp(min=0))


def apply_placement(
    counts: torch.Tensor, placement: ReplicaPlacement, capacity: int | None = None, rounds: int = 4
) -> ReplicaPlan:
    """This micro-batch's plan under the step's placement, from its all-gathered `counts [R, E]`:
    each placed replica takes from its expert's home share what brings the home rank down, or
    its own rank up, to the even share. With `capacity` (the receive buffer per destination) a
    second pass lets a replica's rank go above the even share, up to the capacity, for a home rank
    still over it. The weights are fixed for the step; how many slots each replica takes follows
    the current micro-batch.

    Vectorised (no loop over entries): in a pass the giving ranks (above the level) and the
    receiving ranks (below the ceiling) are disjoint, so each entry's move is bounded by three
    shared budgets, its home rank's surplus, its rank's room and its expert's home share. Each of
    `rounds` rounds proposes `min(surplus, room, share)` per entry from what is left and cuts the
    proposals to every budget in entry order (hottest placement first); what a round leaves the
    next one offers again. Every budget holds after every round."""
    num_ranks, num_experts = counts.shape
    local = num_experts // num_ranks
    device = counts.device
    load = counts.sum(0)
    rank_load = load.view(num_ranks, local).sum(1)
    target = load.sum() // num_ranks
    entries = placement.expert.shape[0]
    expert, dest = placement.expert, placement.dest
    owners = torch.div(expert, local, rounding_mode="floor")
    earlier = torch.ones(entries, entries, dtype=torch.float64, device=device).tril(-1)
    amount = torch.zeros(entries, dtype=torch.int64, device=device)
    home = load.clone()
    levels = (target, capacity) if capacity is not None else (target,)
    for level in levels:
        surplus = (rank_load - level).clamp(min=0)  # giving ranks
        room = (level - rank_load).clamp(min=0)  # receiving ranks
        for _ in range(rounds):
            want = torch.minimum(torch.minimum(surplus[owners], room[dest]), home[expert])
            want = torch.where(placement.valid, want, 0)
            want = _capped_in_order(want, expert, home, earlier)
            want = _capped_in_order(want, owners, surplus, earlier)
            want = _capped_in_order(want, dest, room, earlier)
            amount = amount + want
            home = home.index_add(0, expert, -want)
            surplus = surplus.index_add(0, owners, -want)
            room = room.index_add(0, dest, -want)
            rank_load = rank_load.index_add(0, owners, -want).index_add(0, dest, want)
    plan = _finish_plan(expert, dest, amount, load, home, rank_load)
    plan.slot = placement.slot  # the slots the weights were fetched into, whatever the amounts
    plan.valid = placement.valid & (amount > 0)
    return plan


# ---------------------------------------------------------------------------------------------
# Slot routing


def home_route(expert_flat: torch.Tensor, local_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every slot to its expert's home rank: (destination, local id)."""
    return torch.div(expert_flat, local_experts, rounding_mode="floor"), expert_flat % local_experts


def index_within_expert(expert_flat: torch.Tensor, mine: torch.Tensor) -> torch.Tensor:
    """For each slot, its index among this source's slots of the same expert (slot order);
    `mine [E]` the source's slot counts per expert."""
    slots = expert_flat.shape[0]
    order = torch.sort(expert_flat, stable=True).indices
    first = mine.cumsum(0) - mine
    return torch.empty_like(order).scatter_(
        0, order, torch.arange(slots, device=expert_flat.device) - first[expert_flat[order]]
    )


def replica_route(
    expert_flat: torch.Tensor, counts: torch.Tensor, source: int, plan: ReplicaPlan
) -> tuple[torch.Tensor, torch.Tensor]:
    """`balanced` mode: (destination, local id) of each slot of `source` under `plan`.

    Source `s`'s slots of expert `e` take the contiguous positions `[o, o + c)` of the expert's
    interval `[0, load_e)`, `o` the slots of `e` at lower-ranked sources: every position is taken
    by exactly one slot, so each holder receives exactly its planned share (the receive layout's
    capacity is per destination, so how a source's slots spread over holders does not matter)."""
    num_ranks, num_experts = counts.shape
    local = num_experts // num_ranks
    slots = expert_flat.shape[0]
    offset = counts[:source].sum(0)[expert_flat]
    position = offset + index_within_expert(expert_flat, counts[source])
    # the replica interval holding `position`, if any: search (expert, start) keys
    span = num_ranks * slots + 1  # > any load
    keys = torch.where(plan.valid, plan.expert * span + plan.start, num_experts * span)
    sorted_keys, key_order = torch.sort(keys, stable=True)
    found = torch.searchsorted(sorted_keys, expert_flat * span + position, right=True) - 1
    entry = key_order[found.clamp(min=0)]
    is_replica = (
        (found >= 0)
        & plan.valid[entry]
        & (plan.expert[entry] == expert_flat)
        & (position < plan.start[entry] + plan.amount[entry])
    )
    home_dest, home_id = home_route(expert_flat, local)
    dest = torch.where(is_replica, plan.dest[entry], home_dest)
    local_id = torch.where(is_replica, local + plan.slot[entry], home_id)
    return dest, local_id


def proportional_shares(counts: torch.Tensor, plan: ReplicaPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """Each source's slots of an expert split over its holders in proportion to their planned
    amounts (the relay transport's routing: a (source, holder) pair then carries about the
    holder's share of the source's slots, so pairs follow the balanced destinations instead of
    taking a source's whole count). Returns `(home [R, E], replica [R, N])`: slots each source
    sends to each expert's home rank and to each replica entry. Replica shares are cumulative
    floors over the sources (`floor(c_{<s+1}·a/L) − floor(c_{<s}·a/L)`, so a holder receives its
    planned amount when no source runs out), capped at the source's count; the home takes the rest."""
    load = plan.load.clamp(min=1)
    upto = counts.cumsum(0)[:, plan.expert]  # [R, N] slots of the entry's expert at sources ≤ s
    amount = torch.where(plan.valid, plan.amount, 0)
    scaled = torch.div(upto * amount[None, :], load[plan.expert][None, :], rounding_mode="floor")
    share = scaled - torch.cat([torch.zeros_like(scaled[:1]), scaled[:-1]])
    # cap each source's replica shares of an expert at its count, entries in order
    same_before = torch.ones(share.shape[1], share.shape[1], dtype=torch.bool, device=share.device).tril(-1)
    same_before &= plan.expert[:, None] == plan.expert[None, :]  # [j, j'] j' < j, same expert
    mine = counts[:, plan.expert]
    before = (share.double() @ same_before.double().T).long()
    share = (torch.minimum(before + share, mine) - torch.minimum(before, mine)).clamp(min=0)
    home = counts - torch.zeros_like(counts).index_add_(1, plan.expert, share)
    return home, share


def proportional_route(
    expert_flat: torch.Tensor,
    counts: torch.Tensor,
    source: int,
    plan: ReplicaPlan,
    shares: tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(destination, local id) of each slot of `source` under `proportional_shares`: its slots
    of an expert in slot order, the first `home` to the home rank, then each replica entry's share."""
    num_ranks, num_experts = counts.shape
    local = num_experts // num_ranks
    slots = expert_flat.shape[0]
    home, share = shares[0][source], shares[1][source]
    position = index_within_expert(expert_flat, counts[source])
    same_before = torch.ones(share.shape[0], share.shape[0], dtype=torch.bool, device=share.device).tril(-1)
    same_before &= plan.expert[:, None] == plan.expert[None, :]
    start = home[plan.expert] + (same_before.long() * share[None, :]).sum(1)
    valid = share > 0
    span = slots + 1
    keys = torch.where(valid, plan.expert * span + start, num_experts * span)
    sorted_keys, key_order = torch.sort(keys, stable=True)
    found = torch.searchsorted(sorted_keys, expert_flat * span + position, right=True) - 1
    entry = key_order[found.clamp(min=0)]
    is_replica = (
        (found >= 0) & valid[entry] & (plan.expert[entry] == expert_flat) & (position < start[entry] + share[entry])
    )
    home_dest, home_id = home_route(expert_flat, local)
    return torch.where(is_replica, plan.dest[entry], home_dest), torch.where(
        is_replica, local + plan.slot[entry], home_id
    )


def proportional_pairs(
    counts: torch.Tensor, plan: ReplicaPlan, shares: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """`[R, R]` slots each source sends each destination under `proportional_route`."""
    num_ranks, num_experts = counts.shape
    home, share = shares
    pairs = home.view(num_ranks, num_ranks, num_experts // num_ranks).sum(2)
    return pairs.index_add(1, plan.dest, share)


def pair_slots(counts: torch.Tensor, plan: ReplicaPlan) -> torch.Tensor:
    """`[R, R]` slots each source sends each destination under `replica_route` (the overlaps of
    each source's contiguous range with each holder's interval), computed from the counts alone:
    every rank knows every pair, and so where its rows land in each destination's buffer."""
    num_ranks, num_experts = counts.shape
    local = num_experts // num_ranks
    low = counts.cumsum(0) - counts  # [R, E] each source's range [low, low + count)
    high = low + counts
    home_part = (torch.minimum(high, plan.home[None, :]) - low).clamp(min=0)  # home holds [0, home)
    pairs = home_part.view(num_ranks, num_ranks, local).sum(2)
    end = plan.start + plan.amount
    replica_part = (
        torch.minimum(high[:, plan.expert], end[None, :]) - torch.maximum(low[:, plan.expert], plan.start[None, :])
    ).clamp(min=0)
    replica_part = torch.where(plan.valid[None, :], replica_part, 0)  # [R, N]
    return pairs.index_add(1, plan.dest, replica_part)


def destination_room(pairs: torch.Tensor, capacity: int) -> torch.Tensor:
    """`[R, R]` rows source `s` may send destination `d`: its pair up to what is left of `d`'s
    `capacity` after the lower-ranked sources (the receive buffer is filled in source order)."""
    before = pairs.cumsum(0) - pairs
    return torch.minimum(pairs, (capacity - before).clamp(min=0))


def pair_positions(dest: torch.Tensor, weights_flat: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """Each slot's position among this source's slots to the same destination, by routing
    weight descending (ties: lower slot index first): the order in which a pair's slots are kept."""
    slots = dest.shape[0]
    device = dest.device
    by_weight = torch.sort(weights_flat.detach(), descending=True, stable=True).indices
    order = by_weight[torch.sort(dest[by_weight], stable=True).indices]
    per_dest = torch.zeros(num_ranks, dtype=torch.int64, device=device).scatter_add_(0, dest, torch.ones_like(dest))
    first = per_dest.cumsum(0) - per_dest
    return torch.empty_like(order).scatter_(0, order, torch.arange(slots, device=device) - first[dest[order]])


def pack_slots(
    dest: torch.Tensor, weights_flat: torch.Tensor, num_ranks: int, capacity
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop policy: per destination keep the `capacity` slots of highest routing weight (ties:
    lower slot index first); `capacity` an int or an `[R]` tensor (per destination). Returns
    (buffer_index [S] = `dest · max_capacity + position`, or the trash row `R · max_capacity`;
    keep [S])."""
    slots = dest.shape[0]
    position = pair_positions(dest, weights_flat, num_ranks)
    if isinstance(capacity, torch.Tensor):
        keep = position < capacity[dest]
        row = slots  # a pair never holds more than the source's slots
    else:
        keep = position < capacity
        row = capacity
    buffer_index = torch.where(keep, dest * row + position, num_ranks * row)
    return buffer_index, keep


# ---------------------------------------------------------------------------------------------
# The relay transport: two equal-split all-to-alls of fixed shape, no size exchange


@dataclass(frozen=True)
class RelayCapacity:
    """Rows per (source, destination) pair of the relay transport's two hops, a function of the
    config and the micro-batch size only. Hop 1 `[R, first]`: each pair's first slots (highest
    routing weight) straight to their destination, and in the rows a pair leaves unused, the
    overflow of the source's other pairs; hop 2 `[R, second]`: each relay forwards those rows to
    their destination. A destination can receive `R·(first + second)` rows, the per-destination
    capacity `ceil(capacity_factor · s·k)` the replica planner keeps it under."""

    first: int
    second: int

    @property
    def rows(self) -> int:
        """Rows per pair and all-to-all direction over both hops: `ceil(capacity_factor · s·k/R)`."""
        return self.first + self.second


def relay_capacity(tokens: int, top_k: int, ep: int, capacity_factor: float) -> RelayCapacity:
    """Pair capacities whose sum is `ceil(capacity_factor · s·k / R)` (the wire stays within
    `capacity_factor` of the unpadded rows): hop 1 the even share `s·k/R` plus half the headroom,
    hop 2 the other half (at least one row). Hop 1 always has room for every slot of a source
    (`R · first ≥ s·k`); only hop 2 can overflow. Tuned with `benchmarks/ep_scale.py`."""
    even = math.ceil(tokens * top_k / ep)
    headroom = max(0, math.ceil(capacity_factor * tokens * top_k / ep) - even)
    first = even + headroom // 2
    return RelayCapacity(first, max(1, even + headroom - first))


@dataclass
class RelayPlan:
    """Where every row of every (source, destination) pair travels, identical on every rank (a
    function of the all-gathered counts).

    Pair `(s, d)` sends its first `direct[s, d] = min(P, first)` rows straight. Source `s` numbers
    the rest `t = 0, 1, …` destination after destination (pair `(s, d)` owns
    `[start[s, d], start[s, d] + overflow[s, d])`) and lays them into the rows its pairs leave
    unused (`spare[s, r] = first − direct[s, r]`) level by level: level `ℓ` takes one row on
    each relay with `spare > ℓ`, relays in order from `s + 1` round the ring. `at[s, r, ℓ]` is the
    `t` of relay `r`'s `ℓ`-th row from `s` (increasing in `ℓ`; past its spare: a bound), `counts
    [s, r, d]` how many rows of pair `(s, d)` go through `r`, and `room[s, r, d]` how many of those
    hop 2 takes (`second` rows per (relay, destination), granted source after source)."""

    direct: torch.Tensor  # [R, R]
    overflow: torch.Tensor  # [R, R]
    start: torch.Tensor  # [R, R]
    at: torch.Tensor  # [R, R, first]
    counts: torch.Tensor  # [R(s), R(r), R(d)]
    room: torch.Tensor  # [R(s), R(r), R(d)]
    capacity: RelayCapacity

    @property
    def dropped(self) -> torch.Tensor:
        """`[R, R]` rows of each pair that hop 2 has no room for."""
        return (self.counts - self.room).sum(1)


def plan_relay(pairs: torch.Tensor, capacity: RelayCapacity) -> RelayPlan:
    """The relay plan for `pairs [R, R]` (slots each source sends each destination). Work
    `O(R² · first)`, no loops, no host reads."""
    num_ranks = pairs.shape[0]
    first, device = capacity.first, pairs.device
    direct = pairs.clamp(max=first)
    overflow = pairs - direct
    start = overflow.cumsum(1) - overflow
    spare = first - direct  # [R(s), R(r)]
    level = torch.arange(first, device=device)
    taking = spare[:, :, None] > level[None, None, :]  # [s, r, ℓ]
    # relays in ring order from s + 1: rotate, rank within the level, rotate back
    ranks = torch.arange(num_ranks, device=device)
    ring = (ranks[None, :] + ranks[:, None] + 1) % num_ranks  # [s, i] the i-th relay of s
    taking_ring = taking.gather(1, ring[:, :, None].expand(-1, -1, first))
    rank_ring = taking_ring.long().cumsum(1) - taking_ring.long()
    rank_in_level = torch.empty_like(rank_ring).scatter_(1, ring[:, :, None].expand(-1, -1, first), rank_ring)
    per_level = taking.long().sum(1)  # [s, ℓ]
    base = per_level.cumsum(1) - per_level
    beyond = base[:, -1:] + per_level[:, -1:] + num_ranks * level[None, :] + 1  # increasing past the spare
    at = torch.where(taking, base[:, None, :] + rank_in_level, beyond[:, None, :].expand(-1, num_ranks, -1))
    at = at.contiguous()
    before = _rows_before(at, start)  # [s, r, d] rows of s through r with t < start[s, d]
    counts = _rows_before(at, start + overflow) - before
    earlier = counts.cumsum(0) - counts  # from lower sources through the same (r, d)
    room = torch.minimum(counts, (capacity.second - earlier).clamp(min=0))
    return RelayPlan(direct, overflow, start, at, counts, room, capacity)


def _rows_before(at: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """`[s, r, d]`: levels ℓ with `at[s, r, ℓ] < bound[s, d]`."""
    query = bound[:, None, :].expand(-1, at.shape[1], -1).contiguous()
    return torch.searchsorted(at, query)


def relay_route(
    dest: torch.Tensor, position: torch.Tensor, source: int, plan: RelayPlan
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hop-1 row of each slot of `source` (`dest`, and `position` within its pair from
    `pair_positions`): `hop1_index [S]` = `rank · first + row`, or the trash row `R · first`;
    keep [S] (false where hop 2 has no room for the slot)."""
    num_ranks = plan.direct.shape[0]
    first = plan.capacity.first
    direct, start = plan.direct[source], plan.start[source]
    straight = position < direct[dest]
    t = (start[dest] + position - direct[dest]).clamp(min=0)
    at = plan.at[source]  # [R(r), first]
    # the relay and level of row t: the (r, ℓ) whose at equals t
    flat = at.reshape(-1)
    order = torch.argsort(flat)
    found = order[torch.searchsorted(flat[order], t).clamp(max=flat.numel() - 1)]
    relay, level = torch.div(found, first, rounding_mode="floor"), found % first
    index_in_pair = level - _rows_before(plan.at[source : source + 1], plan.start[source : source + 1])[0][relay, dest]
    relayed = ~straight & (index_in_pair < plan.room[source][relay, dest])
    hop1 = torch.where(
        straight,
        dest * first + position,
        torch.where(relayed, relay * first + direct[relay] + level, num_ranks * first),
    )
    return hop1, straight | relayed


def relay_forward(plan: RelayPlan, relay: int) -> tuple[torch.Tensor, torch.Tensor]:
    """At `relay`: `to_hop2 [R·first]`, the hop-2 row (`destination · second + row`, or the trash
    row `R · second`) of each received hop-1 row, and `direct [R·first]`, whether the row is for
    this rank's own experts. Hop 2 to each destination is filled source after source."""
    num_ranks = plan.direct.shape[0]
    cap = plan.capacity
    device = plan.direct.device
    row = torch.arange(cap.first, device=device)
    direct_rows = plan.direct[:, relay]  # [R(s)]
    level = row[None, :] - direct_rows[:, None]  # [R(s), first]
    at = plan.at[:, relay, :].gather(1, level.clamp(min=0))  # the t of each received row
    total = plan.overflow.sum(1)  # [R(s)] rows each source relays
    is_relayed = (level >= 0) & (at < total[:, None])
    ends = (plan.start + plan.overflow).contiguous()
    dest = torch.searchsorted(ends, at, right=True).clamp(max=num_ranks - 1)  # [R(s), first]
    before = _rows_before(plan.at, plan.start)[:, relay, :]  # [R(s), R(d)]
    index_in_pair = level - before.gather(1, dest)
    room = plan.room[:, relay, :]  # [R(s), R(d)]
    earlier = room.cumsum(0) - room
    kept = is_relayed & (index_in_pair < room.gather(1, dest))
    to_hop2 = torch.where(kept, dest * cap.second + earlier.gather(1, dest) + index_in_pair, num_ranks * cap.second)
    return to_hop2.reshape(-1), (row[None, :] < direct_rows[:, None]).reshape(-1)
