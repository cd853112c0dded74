"""Whether a planned layout fits: the largest rank's total against the per-GPU limit, the same
limit `--search` keeps layouts under (`--memory-limit`, default 90% of the HBM)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from k3train.planning.hardware import MEMORY_LIMIT_SHARE, HardwareProfile
from k3train.planning.memory import GIB, RankMemory


@dataclass(frozen=True)
class MemoryVerdict:
    """The fullest pipeline rank against the limit."""

    largest_gib: float
    largest_pp_rank: int
    limit_gib: float
    limit_source: str  # how the limit was set, for the reader

    @property
    def fits(self) -> bool:
        return self.largest_gib <= self.limit_gib  # as the search compares

    def line(self, search_hint: str) -> str:
        """One line; when the layout does not fit, `search_hint` says how to find one that does."""
        largest, limit = _gib(self.largest_gib), _gib(self.limit_gib)
        if self.fits:
            return f"fits: largest rank {largest} GiB (pp{self.largest_pp_rank}) <= {limit} GiB (limit: {self.limit_source})"
        return (
            f"does not fit: largest rank {largest} GiB (pp{self.largest_pp_rank}) > {limit} GiB "
            f"(limit: {self.limit_source}); {search_hint}"
        )


def _gib(value: float) -> str:
    """One decimal as the memory table prints, three significant digits below 10 GiB (a small
    recipe's ranks would all read 0.0)."""
    return f"{value:,.1f}" if value >= 10 else f"{value:.3g}"


def memory_verdict(
    ranks: Sequence[RankMemory], hardware: HardwareProfile, memory_limit_gib: float | None = None
) -> MemoryVerdict:
    """The verdict for the ranks `rank_memory` priced; `memory_limit_gib` as `--memory-limit`."""
    largest = max(ranks, key=lambda rank: rank.total)
    if memory_limit_gib is not None:
        limit, source = memory_limit_gib, "--memory-limit"
    else:
        limit = hardware.memory_limit_gib()
        source = f"{MEMORY_LIMIT_SHARE:.0%} of the {hardware.memory_gib:g} GB HBM of one {hardware.name}"
    return MemoryVerdict(largest.total / GIB, largest.pp_rank, limit, source)


__all__ = ["MemoryVerdict", "memory_verdict"]
