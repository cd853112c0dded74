"""Progress of a running job, read from the `metrics.jsonl` it appends to, and its one-line summary.

The runner polls its jobs every `poll_s`; a `MetricsFollower` reads only the bytes appended since
its previous read and parses only complete lines (the line a job is still writing waits for the
next poll), so following a long run costs its new records, not the whole file each time.
"""

from __future__ import annotations

import json
import math
import pathlib
from dataclasses import dataclass, field

from k3train.ablation.grid import RunSpec
from k3train.config import load_config


@dataclass
class RunProgress:
    """Where a job stands: its newest logged step and losses, against the steps it will train."""

    planned_steps: int | None = None
    step: int = 0
    loss: float | None = None
    validation_loss: float | None = None

    def summary(self) -> str:
        """'step 120/300 (40%), loss 3.4567, val 3.5012' (the parts known so far)."""
        if self.planned_steps:
            parts = [f"step {self.step}/{self.planned_steps} ({100 * self.step // self.planned_steps}%)"]
        else:
            parts = [f"step {self.step}"]
        if self.loss is not None and math.isfinite(self.loss):
            parts.append(f"loss {self.loss:.4f}")
        if self.validation_loss is not None and math.isfinite(self.validation_loss):
            parts.append(f"val {self.validation_loss:.4f}")
        return ", ".join(parts)


@dataclass
class MetricsFollower:
    """Follows one run's metrics file as it grows (a resumed run's earlier records included)."""

    path: pathlib.Path
    progress: RunProgress = field(default_factory=RunProgress)
    offset: int = 0
    """Bytes of the file already parsed: up to the end of its last complete line."""

    def poll(self) -> RunProgress:
        try:
            with open(self.path, "rb") as metrics:
                metrics.seek(0, 2)
                if metrics.tell() < self.offset:  # the file was replaced: read the new one from the start
                    self.offset = 0
                metrics.seek(self.offset)
                appended = metrics.read()
        except FileNotFoundError:
            return self.progress  # the job has not logged yet
        complete = appended.rfind(b"\n") + 1
        self.offset += complete
        for line in appended[:complete].splitlines():
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
            if not isinstance(record, dict) or "step" not in record:
                continue
            if "validation_loss" in record:
                self.progress.validation_loss = record["validation_loss"]
            elif "loss" in record:
                self.progress.step, self.progress.loss = int(record["step"]), record["loss"]
        return self.progress


def planned_steps(spec: RunSpec) -> int | None:
    """`train.steps` of the run's config; None when the config cannot be read here (the job itself
    reports that error in its train.log)."""
    try:
        return load_config(spec.recipe, list(spec.overrides)).train.steps
    except Exception:  # a display only: a bad config is the job's error to report, not the sweep's
        return None


def format_elapsed(seconds: float) -> str:
    """'45 s', '12 min 05 s', '3 h 07 min'."""
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"
