"""Replica placements for a whole step (`parallel.ep_replica_planning: step`): which expert each
rank hosts in each replica slot, planned on the device at the step boundary from the previous
step's loads, and read on the host once per step for every layer together (`read_host`), for the
replica exchange's split sizes and the checkpoint.

Pure tensor functions like `expert_plan.py`: every rank of the EP group computes the same
placement from the same loads. Layout and the spare rule: docs/expert_parallel.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3train.parallel.expert_plan import ReplicaPlan, apply_placement, plan_from_load


@dataclass
class ReplicaPlacement:
    """`N = R·M` entries, the valid ones first (in planning order), the others zero: entry `j`
    (if `valid[j]`) hosts expert `expert[j]` on rank `dest[j]` in replica slot `slot[j]`. `host`
    lists the valid entries as `(expert, dest, slot)`, read from the device when first asked for
    (or, for many placements in one read, by `read_host`)."""

    expert: torch.Tensor  # [N] int64
    dest: torch.Tensor  # [N] int64
    slot: torch.Tensor  # [N] int64
    valid: torch.Tensor  # [N] bool
    host_entries: list[tuple[int, int, int]] | None = None

    @property
    def host(self) -> list[tuple[int, int, int]]:
        if self.host_entries is None:
            ReplicaPlacement.read_host([self])
        assert self.host_entries is not None
        return self.host_entries

    @staticmethod
    def read_host(placements: list[ReplicaPlacement]) -> None:
        """Fill the host lists of `placements` with one device-to-host read for all of them."""
        if not placements:
            return
        rows = torch.cat([torch.stack([p.expert, p.dest, p.slot, p.valid.long()]) for p in placements], dim=1)
        values = rows.tolist()
        offset = 0
        for placement in placements:
            size = placement.expert.shape[0]
            expert, dest, slot, valid = (column[offset : offset + size] for column in values)
            placement.host_entries = [(e, d, s) for e, d, s, v in zip(expert, dest, slot, valid) if v]
            offset += size

    @classmethod
    def from_entries(
        cls, expert: torch.Tensor, dest: torch.Tensor, slot: torch.Tensor, valid: torch.Tensor
    ) -> ReplicaPlacement:
        """The valid entries moved to the front (stable), the others zeroed: the layout `from_host`
        builds from the same list, so a resumed step computes with identical tensors."""
        order = torch.sort((~valid).to(torch.uint8), stable=True).indices
        valid = valid[order]
        expert, dest, slot = (torch.where(valid, tensor[order], 0) for tensor in (expert, dest, slot))
        return cls(expert, dest, slot, valid)

    @classmethod
    def from_plan(cls, plan: ReplicaPlan) -> ReplicaPlacement:
        return cls.from_entries(plan.expert, plan.dest, plan.slot, plan.valid)

    @classmethod
    def empty(cls, num_ranks: int, max_replicas_per_rank: int, device=None) -> ReplicaPlacement:
        zeros = torch.zeros(num_ranks * max_replicas_per_rank, dtype=torch.int64, device=device)
        return cls(zeros, zeros.clone(), zeros.clone(), zeros.bool(), [])

    @classmethod
    def from_host(
        cls, entries: list[tuple[int, int, int]], num_ranks: int, max_replicas_per_rank: int, device=None
    ) -> ReplicaPlacement:
        """The placement of the `(expert, dest, slot)` entries (as `host` lists them; e.g. restored
        from a checkpoint)."""
        size = num_ranks * max_replicas_per_rank
        entries = [(int(e), int(d), int(s)) for e, d, s in entries]
        padded = entries + [(0, 0, 0)] * (size - len(entries))
        expert, dest, slot = (
            torch.tensor([entry[i] for entry in padded], dtype=torch.int64, device=device) for i in range(3)
        )
        valid = torch.arange(size, device=device) < len(entries)
        return cls(expert, dest, slot, valid, entries)

    @property
    def num_replicas(self) -> int:
        return len(self.host)

    def select(self, keep_self: torch.Tensor, other: ReplicaPlacement) -> ReplicaPlacement:
        """This placement where the 0-dim bool `keep_self` holds, else `other` (on the device)."""
        expert, dest, slot, valid = (
            torch.where(keep_self, mine, theirs) for mine, theirs in zip(self.tensors(), other.tensors())
        )
        return ReplicaPlacement(expert, dest, slot, valid)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.expert, self.dest, self.slot, self.valid

    def with_spares(self, load: torch.Tensor, rank_load: torch.Tensor, max_replicas_per_rank: int) -> ReplicaPlacement:
        """Fill the replica slots this placement leaves free with the hottest experts not yet
        replicated (load above zero; ties: lower id), headroom for the micro-batches of the step
        whose loads differ from the previous step's. The free slots in order: ranks by planned
        load `rank_load` (least first, ties: lower rank), a rank's slots in order; the `i`-th
        candidate takes the `i`-th free slot, unless that slot is on the candidate's home rank:
        then the slot stays free (a replica on its home would add nothing). On the device, a
        fixed number of operations whatever `R`, nothing read on the host."""
        num_ranks, num_experts = rank_load.shape[0], load.shape[0]
        local, entries = num_experts // num_ranks, self.expert.shape[0]
        device = load.device
        placed = self.valid.long()
        used = torch.zeros(num_ranks, dtype=torch.int64, device=device).index_add(0, self.dest, placed)
        replicated = torch.zeros(num_experts, dtype=torch.int64, device=device).index_add(0, self.expert, placed)
        hottest, candidates = torch.sort(load, descending=True, stable=True)
        eligible = (hottest > 0) & (replicated[candidates] == 0)
        candidates = candidates[torch.sort((~eligible).to(torch.uint8), stable=True).indices]
        by_load = torch.sort(rank_load, stable=True).indices
        free = torch.arange(max_replicas_per_rank, device=device) >= used[by_load][:, None]  # [R, M]
        sequence = torch.sort((~free).view(-1).to(torch.uint8), stable=True).indices
        free_rank = by_load[torch.div(sequence, max_replicas_per_rank, rounding_mode="floor")]
        # entry layout: this placement's valid entries (at the front), then spare i at entry n + i
        spare = torch.arange(entries, device=device) - placed.sum()
        index = spare.clamp(min=0)
        expert = candidates[index.clamp(max=num_experts - 1)]
        rank = free_rank[index]
        is_spare = (spare >= 0) & (spare < eligible.sum()) & (torch.div(expert, local, rounding_mode="floor") != rank)
        return ReplicaPlacement.from_entries(
            torch.where(self.valid, self.expert, expert),
            torch.where(self.valid, self.dest, rank),
            torch.where(self.valid, self.slot, sequence[index] % max_replicas_per_rank),
            self.valid | is_spare,
        )


def top_up_placement(
    counts: torch.Tensor, placement: ReplicaPlacement, capacity: int, top_up_slots: int, tolerance: float
) -> ReplicaPlacement:
    """The step's placement with this micro-batch's top-ups after it (`parallel.ep_top_up_replicas`):
    the placement's replicas take their amounts (`apply_placement`); a rank still above
    `(1 + tolerance)` times the even share (`tolerance = capacity_factor − 1`: one that would drop)
    gives its hottest home experts' slots to `top_up_slots` more slots per rank
    (`plan_from_load` on what stays home, the placement's amounts counted where they landed),
    placed in slots `M … M + top_up_slots − 1` after the placement's `M`. Nothing is topped up
    where the placement suffices, so no weights travel then."""
    num_ranks, num_experts = counts.shape
    local = num_experts // num_ranks
    base = apply_placement(counts, placement, capacity)
    placed = base.rank_load - base.home.view(num_ranks, local).sum(1)  # replica slots' amounts per rank
    top = plan_from_load(base.home, num_ranks, top_up_slots, tolerance, extra_load=placed)
    slots = placement.expert.shape[0] // num_ranks
    return ReplicaPlacement(
        torch.cat([placement.expert, top.expert]),
        torch.cat([placement.dest, top.dest]),
        torch.cat([placement.slot, top.slot + slots]),
        torch.cat([placement.valid, top.valid]),
    )
