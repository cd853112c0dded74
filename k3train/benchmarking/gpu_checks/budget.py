"""tools/gpu_check.py's time budget: which checks fit, and a clean stop when one overruns.

A lent GPU gives a fixed time for everything (start-up included), so the checks run in order of
value (the registry's groups) and `--budget SECONDS` starts a check only if its estimated time
fits in what is left; one that does not is skipped and named at the end, with the command that
runs the rest. Estimates: the seconds a previous run measured (`--estimates PATH`, the JSON of
`--json`), else the registry's own (CPU: measured on a 2-core machine; CUDA: sized from the
parts of the full run, to be replaced by the first GPU run's measurements). A check that
overruns is stopped at the budget (`BudgetExceeded`, raised by an interval timer between Python
operations) and the run ends there: every row it produced stays in the table.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

from k3train.errors import UserError

RESERVE_S = 3.0
"""Seconds kept back from the budget for the final table and the JSON after the last check."""


class BudgetExceeded(BaseException):
    """Raised inside a running check when the budget's end arrives. A BaseException (as
    KeyboardInterrupt) so that no check's `except Exception` turns it into a FAIL row."""


def seconds_since_process_start() -> float:
    """Wall seconds since this process started (imports included): Linux's /proc, else 0."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])  # field 22 of stat(5): starttime, counted from `)` onwards
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


def load_estimates(path: str | None) -> dict[str, float]:
    """Per-check seconds from a previous run's `--json` file (its `seconds` section)."""
    if path is None:
        return {}
    try:
        report = json.loads(Path(path).read_text())
        return {str(name): float(seconds) for name, seconds in report["seconds"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise UserError(
            f"--estimates {path}: not a gpu_check --json report with a 'seconds' section ({exc}); "
            f"pass the file a previous `tools/gpu_check.py --json PATH` run wrote"
        ) from exc


class Budget:
    """The run's deadline (None: no budget). `fits(estimate)`: whether a check of `estimate`
    seconds still fits; `stop_at_deadline()`: a context in which the deadline raises
    `BudgetExceeded` (POSIX interval timer, main thread)."""

    def __init__(self, seconds: float | None, already_spent: float = 0.0):
        self.seconds = seconds
        self.started = time.perf_counter() - already_spent
        self.deadline = None if seconds is None else self.started + seconds - RESERVE_S

    def elapsed(self) -> float:
        """Seconds since the run started (the process's start-up included where given)."""
        return time.perf_counter() - self.started

    def left(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - time.perf_counter()

    def fits(self, estimate_s: float) -> bool:
        return estimate_s <= self.left()

    @contextlib.contextmanager
    def stop_at_deadline(self) -> Iterator[None]:
        if self.deadline is None or not hasattr(signal, "setitimer"):
            yield
            return

        def expire(signum, frame):
            raise BudgetExceeded(f"the budget of {self.seconds:g} s ran out")

        previous = signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, max(self.left(), 1e-3))
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


def rest_command(names: list[str], argv_rest: list[str]) -> str:
    """The command line that runs the checks `names` (the ones left out), with the run's other
    options (`--device`, `--quick`)."""
    return " ".join(["python tools/gpu_check.py", *argv_rest, *(f"--only {name}" for name in names)])


__all__ = [
    "Budget",
    "BudgetExceeded",
    "RESERVE_S",
    "load_estimates",
    "rest_command",
    "seconds_since_process_start",
]
