"""The run's last line, `done: step N, loss A (step a) → B (step N)`.

After a resume the process has trained only the last stretch, so its own first loss is not the
run's. The run's first loss is read back from `metrics.jsonl` in the run directory (appended to
by every process of the run): the earliest step logged up to the resume, its last record (a
fresh start in the same directory logs that step again, later in the file, and is the run's
start). Without such a record the line says where this process resumed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["done_line", "first_logged_loss"]


def first_logged_loss(metrics_path: Path, up_to_step: int) -> tuple[int, float] | None:
    """`(step, loss)` of the earliest training step logged in `metrics_path` at or before
    `up_to_step` (its last record), None without one."""
    found: tuple[int, float] | None = None
    try:
        with open(metrics_path, encoding="utf-8") as stream:
            for line in stream:
                try:
                    record = json.loads(line)
                except ValueError:  # a line cut by a crash mid-write
                    continue
                if not isinstance(record, dict):
                    continue
                step, loss = record.get("step"), record.get("loss")
                if (
                    isinstance(step, int)
                    and isinstance(loss, (int, float))
                    and step <= up_to_step
                    and (found is None or step <= found[0])
                ):
                    found = (step, float(loss))
    except OSError:
        return None
    return found


def done_line(history: Sequence[dict[str, Any]], resumed_at: int, metrics_path: Path | None) -> str:
    """The line for a run that ended at `history[-1]`, this process having started at step
    `resumed_at` (0: a fresh start) and trained `history` (non-empty)."""
    last = history[-1]
    first: tuple[int, float] | None = (history[0]["step"], history[0]["loss"]) if resumed_at == 0 else None
    where = ""
    if first is None and metrics_path is not None:
        first = first_logged_loss(metrics_path, resumed_at)
    if first is None:  # the run's start is not on record here (another run directory, no metrics.jsonl)
        first, where = (history[0]["step"], history[0]["loss"]), f", since resume at step {resumed_at}"
    return (
        f"done: step {last['step']}, loss {_loss(first[1])} (step {first[0]}{where}) → "
        f"{_loss(last['loss'])} (step {last['step']})"
    )


def _loss(value: float) -> str:
    return f"{value:.4f}" if math.isfinite(value) else str(value)
