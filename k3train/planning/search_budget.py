"""The wall-clock budget and the progress bar of a layout search.

One `SearchBudget` is shared by every search of one command (`tools/plan.py` at a refused world
size searches that size, probes the nearest sizes and then searches the ones that fit), so
`--budget SECONDS` bounds the whole command, and each search reports the layouts it left out.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tqdm import tqdm


@dataclass
class SearchBudget:
    """A deadline `seconds` after creation (None: no deadline), and whether to draw progress bars.
    `clock` is injectable so that a test can stop a search after a known number of layouts."""

    seconds: float | None = None
    show_progress: bool = False
    clock: Callable[[], float] = time.monotonic
    started: float = field(init=False)

    def __post_init__(self) -> None:
        self.started = self.clock()

    def elapsed(self) -> float:
        return self.clock() - self.started

    def expired(self) -> bool:
        return self.seconds is not None and self.elapsed() >= self.seconds

    def progress(self, total: int, description: str, keep: bool = True) -> tqdm:
        """A bar on stderr over `total` layouts (silent unless `show_progress`: tests and pipes
        read stdout only, and a bar in a log is a line per refresh)."""
        return tqdm(
            total=total,
            desc=description,
            unit="layout",
            file=sys.stderr,
            leave=keep,
            disable=not self.show_progress,
            dynamic_ncols=True,
        )


__all__ = ["SearchBudget"]
