"""The finished runs of a sweep, summarised per arm: final losses over seeds, cost, throughput.

`collect` reads every run's curves and cost; `summarise` groups them by (size, arm) and computes
the statistics the report's table shows. The compared quantity is the final validation loss
when every run evaluated its final step, else the mean training loss of the last `window` steps
(the report says which).
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence
from dataclasses import dataclass

from k3train.ablation import stats
from k3train.ablation.curves import RunCurves, read_curves
from k3train.ablation.grid import RunSpec
from k3train.ablation.matching import RunCost, run_cost
from k3train.ablation.runner import read_record


@dataclass
class RunResult:
    spec: RunSpec
    run_dir: pathlib.Path
    curves: RunCurves
    cost: RunCost
    """From the run's config: tokens per step, FLOPs per token, parameters."""

    @property
    def tokens(self) -> list[int]:
        return [step * self.cost.tokens_per_step for step in self.curves.steps]

    @property
    def trained_flops(self) -> float:
        return self.curves.last_step * self.cost.tokens_per_step * self.cost.flops_per_token


def collect(runs: Sequence[RunSpec], out: pathlib.Path) -> list[RunResult]:
    """Every finished run (`done` in its ablate_run.json, of these settings): a run in progress or
    failed would mix a shorter curve into the seed statistics."""
    results = []
    for spec in runs:
        run_dir = out / spec.relative_dir
        record = read_record(run_dir)
        if record is None or record.get("status") != "done" or record.get("overrides") != list(spec.overrides):
            continue
        curves = read_curves(run_dir / "metrics.jsonl")
        if curves.steps:
            results.append(RunResult(spec, run_dir, curves, run_cost(spec.recipe, spec.overrides)))
    return results


@dataclass
class ArmSummary:
    size: str | None
    arm: str
    final: dict[int, float]
    """Seed index → the compared final loss."""
    final_train: dict[int, float | None]
    steps: int
    tokens: int
    trained_flops: float
    throughput: float | None
    """Mean over seeds of each run's median tokens/s."""
    parameters: int
    active_parameters: int
    flops_per_token: float
    difference: stats.Interval | None = None
    """Against the baseline arm of the same size; None for the baseline itself."""
    baseline: str | None = None

    @property
    def mean(self) -> float:
        return stats.mean(list(self.final.values()))

    @property
    def std(self) -> float:
        return stats.sample_std(list(self.final.values()))


def compared_metric(results: Sequence[RunResult]) -> str:
    """'validation' when every run has a validation loss at its final step, else 'train'."""
    if results and all(r.curves.final_validation() is not None for r in results):
        return "validation"
    return "train"


def summarise(
    results: Sequence[RunResult], baselines: dict[str, str], window: int, confidence: float = 0.95
) -> list[ArmSummary]:
    """One summary per (size, arm), in the order the runs were given; `baselines` maps each arm to
    the arm its difference is taken against."""
    metric = compared_metric(results)
    groups: dict[tuple[str | None, str], list[RunResult]] = {}
    for result in results:
        groups.setdefault((result.spec.size, result.spec.arm), []).append(result)
    summaries = []
    for (size, arm), members in groups.items():
        finals = {}
        for r in members:
            value = r.curves.final_validation() if metric == "validation" else r.curves.final_train(window)
            if value is not None:
                finals[r.spec.seed_index] = value
        throughputs = [t for t in (r.curves.steady_throughput() for r in members) if t is not None]
        cost = members[0].cost
        summaries.append(
            ArmSummary(
                size=size,
                arm=arm,
                final=finals,
                final_train={r.spec.seed_index: r.curves.final_train(window) for r in members},
                steps=max(r.curves.last_step for r in members),
                tokens=max(r.curves.last_step for r in members) * cost.tokens_per_step,
                trained_flops=stats.mean([r.trained_flops for r in members]),
                throughput=stats.mean(throughputs) if throughputs else None,
                parameters=cost.parameters,
                active_parameters=cost.active_parameters,
                flops_per_token=cost.flops_per_token,
            )
        )
    by_key = {(s.size, s.arm): s for s in summaries}
    for summary in summaries:
        baseline_arm = baselines.get(summary.arm)
        base = by_key.get((summary.size, baseline_arm)) if baseline_arm is not None else None
        if base is not None and base is not summary and summary.final and base.final:
            summary.difference = stats.difference_interval(summary.final, base.final, confidence)
            summary.baseline = base.arm
    return summaries
