"""Compute- and token-matched step counts, from the analytic counts of `k3train/model/flops.py`.

`--match flops` gives every arm the training FLOPs its baseline spends: a variant that costs more
per token trains for fewer steps. `--match tokens` gives every arm the baseline's tokens (arms
that change the batch or the sequence length get the step count that restores them).

Validation runs only at multiples of `train.eval_interval`, and the final validation loss is what
the report compares, so a matched run keeps the baseline's number of evaluations `n` and gets
`eval_interval = round(steps / n)`, `steps = n · eval_interval`: the final step is evaluated, and
the match is off by at most `n/2` steps (the report prints each run's realised FLOPs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from k3train.ablation.grid import RunSpec

from k3train.config import load_config
from k3train.model.flops import parameter_counts, training_flops_per_token


@dataclass(frozen=True)
class RunCost:
    """What one run of a recipe with overrides costs, from its config alone."""

    steps: int
    tokens_per_step: int
    flops_per_token: float
    """Training (forward + backward) model FLOPs per token, MLA counted causally."""
    parameters: int
    active_parameters: int
    eval_interval: int

    @property
    def tokens(self) -> int:
        return self.steps * self.tokens_per_step

    @property
    def flops(self) -> float:
        return self.tokens * self.flops_per_token


def run_cost(recipe: str, overrides: tuple[str, ...] = ()) -> RunCost:
    config = load_config(recipe, list(overrides))
    counts = parameter_counts(config.model)
    return RunCost(
        steps=config.train.steps,
        tokens_per_step=config.train.global_batch_size * config.data.seq_length,
        flops_per_token=training_flops_per_token(config.model, config.data.seq_length).total,
        parameters=counts.total,
        active_parameters=counts.active,
        eval_interval=config.train.eval_interval,
    )


def matched_steps(target: float, per_step: float, evaluations: int) -> tuple[int, int]:
    """(steps, eval_interval) spending about `target` at `per_step` each, the final step evaluated.

    `evaluations` is the baseline's number of validation passes (0: no validation, steps are
    rounded alone)."""
    if per_step <= 0 or target <= 0:
        raise ValueError(f"matched_steps needs positive target and per_step, got {target}, {per_step}")
    exact = target / per_step
    if evaluations <= 0:
        return max(1, round(exact)), 0
    interval = max(1, round(exact / evaluations))
    return interval * evaluations, interval


def match_overrides(mode: str, baseline: RunCost, arm: RunCost) -> tuple[str, ...]:
    """Overrides that give `arm` the baseline's FLOPs (`mode='flops'`) or tokens (`'tokens'`)."""
    evaluations = baseline.steps // baseline.eval_interval if baseline.eval_interval else 0
    if mode == "flops":
        steps, interval = matched_steps(baseline.flops, arm.tokens_per_step * arm.flops_per_token, evaluations)
    elif mode == "tokens":
        steps, interval = matched_steps(baseline.tokens, arm.tokens_per_step, evaluations)
    else:
        raise ValueError(f"match mode must be 'flops' or 'tokens', got {mode!r}")
    extra = (f"train.steps={steps}",)
    return extra + ((f"train.eval_interval={interval}",) if evaluations else ())


def apply_match(runs: Sequence[RunSpec], mode: str, baselines: dict[str, str]) -> list[RunSpec]:
    """The runs with step overrides that match each run to its baseline arm's run of the same size
    (`baselines` maps an arm to its baseline arm; seeds do not change the cost)."""
    costs = {spec: run_cost(spec.recipe, spec.overrides) for spec in runs}
    reference = {(spec.size, spec.arm): costs[spec] for spec in runs}
    matched = []
    for spec in runs:
        base = reference.get((spec.size, baselines[spec.arm]))
        if base is None:
            raise ValueError(f"--match needs the baseline arm {baselines[spec.arm]!r} in every size")
        matched.append(spec.with_overrides(match_overrides(mode, base, costs[spec])))
    return matched
