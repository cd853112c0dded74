"""The step boundary's spare replicas as the host loop first computed them: the reference
`ReplicaPlacement.with_spares` (on the device) is held to in `test_expert_planning_cost.py`."""

from __future__ import annotations

import torch


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
