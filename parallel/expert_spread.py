"""The `spread` transport: two equal-split all-to-alls of fixed shape that deliver every slot
whenever no destination receives more than its capacity, whatever the (source, destination) pairs.

Two-phase routing. A source numbers its slots destination after destination
(`q = start[s, d] + position`, `start` the exclusive prefix of its pair counts) and sends slot `q`
to intermediate rank `(q + s) mod R`, in row `q // R`: every (source, intermediate) pair carries
at most `C1 = ceil(s·k / R)` rows (hop 1, `[R, C1]`). The intermediate forwards each row to its
destination (hop 2, `[R, C2]`); a (source, destination) pair's `P` slots land on consecutive
residues, so an intermediate holds `floor(P/R)` or `ceil(P/R)` of them, and the rows one
intermediate forwards to `d` number at most `Σ_s ceil(P[s, d] / R) ≤ D_d / R + R − 1` (`D_d` the
slots bound for `d`). With `C2 = ceil(C_dest / R) + R` no row is ever dropped while every
destination stays within `C_dest` (which the replica planner ensures). Combine runs both hops
backwards. Every row's place is arithmetic on the all-gathered pair counts: `O(R³)` integer work
per MoE layer and micro-batch, no loops, nothing read on the host.

Wire per rank and direction: `R·(C1 + C2) ≈ (1 + capacity_factor)·s·k + R²` rows, about twice
the relay's, the price of a bound that holds for any pairs. Layout and measurements:
docs/expert_parallel.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SpreadCapacity:
    """Rows per (source, intermediate) pair in hop 1 and per (intermediate, destination) pair in
    hop 2, functions of the config and the micro-batch size only."""

    first: int
    second: int

    @property
    def rows(self) -> int:
        return self.first + self.second


def spread_capacity(slots: int, ep: int, destination_capacity: int) -> SpreadCapacity:
    """`C1 = ceil(s·k / R)`, `C2 = ceil(C_dest / R) + R` (the rounding of each source's pair)."""
    return SpreadCapacity(max(1, math.ceil(slots / ep)), math.ceil(destination_capacity / ep) + ep)


def _on_residue(low: torch.Tensor, high: torch.Tensor, residue: torch.Tensor, ranks: int) -> torch.Tensor:
    """`#{q ∈ [low, high) : q ≡ residue (mod R)}` elementwise (non-negative integers)."""

    def upto(bound: torch.Tensor) -> torch.Tensor:  # #{0 ≤ q < bound : q ≡ residue}
        return torch.div(bound - residue + ranks - 1, ranks, rounding_mode="floor").clamp(min=0)

    return upto(high) - upto(low)


@dataclass
class SpreadPlan:
    """`start [R, R]`: first number of pair `(s, d)` in source `s`'s numbering; `held [s, r, d]`:
    rows of pair `(s, d)` at intermediate `r`; `before [s, r, d]`: rows for `d` at `r` from lower
    sources (hop 2 of `(r, d)` is filled source after source)."""

    pairs: torch.Tensor
    start: torch.Tensor
    held: torch.Tensor
    before: torch.Tensor
    capacity: SpreadCapacity

    @property
    def dropped(self) -> torch.Tensor:
        """`[R, R]` rows of each (source, destination) pair beyond hop 2's `C2` (none while every
        destination is within its capacity)."""
        kept = (self.capacity.second - self.before).clamp(min=0)
        return (self.held - torch.minimum(self.held, kept)).sum(1)


def plan_spread(pairs: torch.Tensor, capacity: SpreadCapacity) -> SpreadPlan:
    """The spread plan for `pairs [R, R]` (slots each source sends each destination)."""
    ranks = pairs.shape[0]
    device = pairs.device
    start = pairs.cumsum(1) - pairs
    rank = torch.arange(ranks, device=device)
    residue = (rank[None, :] - rank[:, None]) % ranks  # [s, r]: numbers of s that go to r
    low = start[:, None, :]  # [s, 1, d]
    held = _on_residue(low, low + pairs[:, None, :], residue[:, :, None], ranks)  # [s, r, d]
    before = held.cumsum(0) - held
    return SpreadPlan(pairs, start, held, before, capacity)


def spread_route(dest: torch.Tensor, position: torch.Tensor, source: int, plan: SpreadPlan) -> torch.Tensor:
    """Hop-1 row of each slot of `source` (`dest`, `position` within its pair): `r · C1 + q // R`."""
    ranks = plan.pairs.shape[0]
    number = plan.start[source][dest] + position
    return ((number + source) % ranks) * plan.capacity.first + torch.div(number, ranks, rounding_mode="floor")


def spread_forward(plan: SpreadPlan, intermediate: int) -> tuple[torch.Tensor, torch.Tensor]:
    """At `intermediate`: `to_hop2 [R·C1]`, the hop-2 row (`d · C2 + row`, or the trash row
    `R · C2`) of each received hop-1 row, and `keep [R·C1]` (a real row with room in hop 2)."""
    ranks = plan.pairs.shape[0]
    cap = plan.capacity
    device = plan.pairs.device
    source = torch.arange(ranks, device=device)[:, None]  # [s, 1]
    row = torch.arange(cap.first, device=device)[None, :]  # [1, C1]
    residue = (intermediate - source) % ranks
    number = row * ranks + residue  # [s, C1]: the source's slot number in this row
    total = plan.pairs.sum(1)[:, None]
    real = number < total
    ends = (plan.start + plan.pairs).contiguous()
    dest = torch.searchsorted(ends, number, right=True).clamp(max=ranks - 1)  # [s, C1]
    first_of_pair = plan.start.gather(1, dest)
    within = _on_residue(first_of_pair, number, residue.expand_as(number), ranks)  # earlier rows of the pair here
    slot = plan.before[:, intermediate, :].gather(1, dest) + within
    keep = real & (slot < cap.second)
    to_hop2 = torch.where(keep, dest * cap.second + slot, ranks * cap.second)
    return to_hop2.reshape(-1), keep.reshape(-1)


def spread_kept(dest: torch.Tensor, position: torch.Tensor, source: int, plan: SpreadPlan) -> torch.Tensor:
    """`[S]` whether each slot of `source` gets a hop-2 row (all of them while the destinations are
    within their capacity)."""
    ranks = plan.pairs.shape[0]
    number = plan.start[source][dest] + position
    intermediate = (number + source) % ranks
    residue = (intermediate - source) % ranks
    within = _on_residue(plan.start[source][dest], number, residue, ranks)
    return plan.before[source][intermediate, dest] + within < plan.capacity.second
