"""The replica planner as it was first written, a greedy of `R·M` iterations on the device: the
reference `parallel/expert_plan.plan_from_load` (a fixed number of operations) is held to in
`test_expert_plan.py` (same per-destination capacity on random routings, same plan where the
ranks' order does not change during the greedy)."""

from __future__ import annotations

import torch

from k3train.parallel.expert_plan import ReplicaPlan, _at, _finish_plan


def greedy_plan_from_load(
    load: torch.Tensor, num_ranks: int, max_replicas_per_rank: int, tolerance: float = 0.0
) -> ReplicaPlan:
    """Each of `R·M` iterations moves from the most loaded rank (first of them) its hottest
    remaining home share to the least loaded rank with a free replica slot (not the source), at
    most down (up) to the even share; a rank is relieved only while above `(1 + tolerance)`
    times the even share."""
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


def host_spares(
    entries: list[tuple[int, int, int]], load: torch.Tensor, rank_load: torch.Tensor, max_replicas_per_rank: int
) -> list[tuple[int, int, int]]:
    """Fill the replica slots the plan left free with the hottest experts not yet replicated,
    each on the least loaded rank with a free slot (not its home): headroom for the micro-
    batches of the step whose loads differ from the previous step's. Host work, at the step
    boundary."""
    num_ranks = rank_load.shape[0]
    local = load.shape[0] // num_ranks
    entries = list(entries)
    used = [0] * num_ranks
    for _, dest, _ in entries:
        used[dest] += 1
    replicated = {expert for expert, _, _ in entries}
    planned = rank_load.tolist()
    for expert in torch.argsort(load, descending=True, stable=True).tolist():
        if all(count >= max_replicas_per_rank for count in used):
            break
        if expert in replicated or int(load[expert]) == 0:
            continue
        free = [r for r in range(num_ranks) if used[r] < max_replicas_per_rank and r != expert // local]
        if not free:
            continue
        dest = min(free, key=lambda r: (planned[r], r))
        entries.append((expert, dest, used[dest]))
        used[dest] += 1
        replicated.add(expert)
    return entries
