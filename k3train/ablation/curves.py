"""A run's curves, read from its `metrics.jsonl`, and their alignment over seeds.

A resumed run appends to its metrics file: the steps between its last checkpoint and the
interruption appear twice (and a run restarted without a checkpoint repeats from step 1). The
record written last for a step is the one the finished run stands on, so every reader here keeps
the last record per step.
"""

from __future__ import annotations

import json
import math
import pathlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

STEP_FIELDS = ("loss", "grad_norm", "tokens_per_s", "expert_load_max_over_mean", "dropped_tokens")


@dataclass
class RunCurves:
    """One run's per-step series (by step) and its validation losses."""

    steps: list[int] = field(default_factory=list)
    series: dict[str, list[float | None]] = field(default_factory=dict)
    validation_steps: list[int] = field(default_factory=list)
    validation_loss: list[float | None] = field(default_factory=list)

    @property
    def last_step(self) -> int:
        return self.steps[-1] if self.steps else 0

    def final_validation(self) -> float | None:
        """The validation loss at the final step, None unless the final step was evaluated."""
        if self.validation_steps and self.steps and self.validation_steps[-1] == self.steps[-1]:
            return self.validation_loss[-1]
        return None

    def final_train(self, window: int) -> float | None:
        """Mean training loss of the last `window` steps (the noise of one batch averaged out)."""
        losses = [v for v in self.series.get("loss", [])[-window:] if v is not None]
        return math.fsum(losses) / len(losses) if losses else None

    def steady_throughput(self, skip: int = 3) -> float | None:
        """Median tokens/s after the first `skip` steps (start-up and allocation)."""
        values = sorted(v for v in self.series.get("tokens_per_s", [])[skip:] if v is not None)
        if not values:
            values = sorted(v for v in self.series.get("tokens_per_s", []) if v is not None)
        if not values:
            return None
        middle = len(values) // 2
        return values[middle] if len(values) % 2 else 0.5 * (values[middle - 1] + values[middle])


def read_curves(metrics_path: pathlib.Path) -> RunCurves:
    """The curves of one run; empty when the file does not exist (a run not yet started)."""
    if not metrics_path.exists():
        return RunCurves()
    by_step: dict[int, dict] = {}
    validation: dict[int, float | None] = {}
    for line in metrics_path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # the last line of a run killed mid-write
        if "validation_loss" in record:
            validation[int(record["step"])] = record["validation_loss"]
        elif "loss" in record:
            by_step[int(record["step"])] = record
    steps = sorted(by_step)
    # A run restarted from scratch after a longer first attempt: keep the steps up to its newest.
    curves = RunCurves(steps=steps, series={name: [by_step[s].get(name) for s in steps] for name in STEP_FIELDS})
    curves.validation_steps = sorted(validation)
    curves.validation_loss = [validation[s] for s in curves.validation_steps]
    return curves


def ema(values: Sequence[float | None], alpha: float) -> list[float | None]:
    """Exponential moving average with bias correction (as TensorBoard's smoothing); `alpha` is the
    weight of the past, 0 returns the values unchanged. None entries are carried over."""
    if not 0.0 <= alpha < 1.0:
        raise ValueError(f"smoothing must lie in [0, 1), got {alpha}")
    smoothed: list[float | None] = []
    average, weight = 0.0, 0.0
    for value in values:
        if value is None:
            smoothed.append(None)
            continue
        average = alpha * average + (1.0 - alpha) * value
        weight = alpha * weight + (1.0 - alpha)
        smoothed.append(average / weight)
    return smoothed


@dataclass
class Band:
    """Mean and min–max over seeds at common x positions."""

    x: list[float]
    mean: list[float]
    low: list[float]
    high: list[float]
    seeds: int = 1
    """Series the band is taken over: with one there is no band (low = mean = high)."""


def band(per_seed: Sequence[tuple[Sequence[float], Sequence[float | None]]]) -> Band | None:
    """The mean line and min–max band of several seeds' (x, y) series, at the x values all of them
    have (runs of one arm share their step grid); None when they share none."""
    if not per_seed:
        return None
    maps = [{x: y for x, y in zip(xs, ys) if y is not None and math.isfinite(y)} for xs, ys in per_seed]
    common = sorted(set.intersection(*(set(m) for m in maps)))
    if not common:
        return None
    columns = [[m[x] for m in maps] for x in common]
    return Band(
        x=list(common),
        mean=[math.fsum(c) / len(c) for c in columns],
        low=[min(c) for c in columns],
        high=[max(c) for c in columns],
        seeds=len(per_seed),
    )


def band_caption(seed_counts: Iterable[int]) -> str:
    """How to read the shading of a figure (or table) whose arms have these numbers of seeds: a
    single seed has no spread to shade, and saying "min–max" over it would claim one."""
    counts = sorted(set(seed_counts))
    if not counts or counts == [1]:
        return "1 seed: no band"
    if counts[0] == 1:
        return "band: min–max over seeds (arms with 1 seed: no band)"
    seeds = f"{counts[0]} seeds" if len(counts) == 1 else "seeds"
    return f"band: min–max over {seeds}"
