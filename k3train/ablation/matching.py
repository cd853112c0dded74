"""Compute- and token-matched step counts, from the analytic counts of `k3train/model/flops.py`.

`--match flops` gives every arm the training FLOPs its baseline spends: a variant that costs more
per token trains for fewer steps. `--match tokens` gives every arm the baseline's tokens (arms
that change the batch or the sequence length get the step count that restores them).

The match is to within one step: `train.steps` is the exact step count rounded. Validation runs
only at multiples of `train.eval_interval` and the report compares the loss at the final step, so
the interval is the divisor of the matched steps nearest the baseline's spacing (as a share of
the run): the final step is always evaluated. When no divisor comes within 2× of that spacing (a
prime step count), the exact count rounded the other way is taken if its divisors do better.
Rounding the steps to whole baseline intervals instead (as before) left short runs unmatched:
with few steps per interval the nearest multiple is usually the baseline's own step count.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

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


EVAL_SPACING_TOLERANCE = 2.0
"""The nearest step count is kept when one of its divisors lies within this factor of the wanted
evaluation spacing; otherwise the other neighbour of the exact count is tried (a prime count has
only 1 and itself: evaluating every step, or only at the end)."""


@dataclass(frozen=True)
class MatchedSteps:
    steps: int
    eval_interval: int
    """A divisor of `steps` (the final step is evaluated); 0 when the baseline never validates."""


def divisors(number: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(number) + 1) if number % d == 0]
    return sorted(set(small + [number // d for d in small]))


def nearest_divisor(number: int, spacing: float) -> int:
    """The divisor of `number` closest to `spacing` as a ratio (10 and 40 are equally far from 20)."""
    return min(divisors(number), key=lambda d: (abs(math.log(d / spacing)), d))


def matched_steps(target: float, per_step: float, spacing: float) -> MatchedSteps:
    """The steps spending `target` at `per_step` each to within one step, with an evaluation
    interval dividing them near `spacing` steps (0: no validation, no interval)."""
    if per_step <= 0 or target <= 0:
        raise ValueError(f"matched_steps needs positive target and per_step, got {target}, {per_step}")
    exact = target / per_step
    nearest = max(1, round(exact))
    if spacing <= 0:
        return MatchedSteps(nearest, 0)
    # Both neighbours of the exact count are less than one step off; the nearest comes first.
    candidates = [nearest] + [n for n in (math.floor(exact), math.ceil(exact)) if n >= 1 and n != nearest]
    spacing = min(max(spacing, 1.0), float(nearest))
    choices = [MatchedSteps(n, nearest_divisor(n, spacing)) for n in candidates]
    first = choices[0]
    if abs(math.log(first.eval_interval / spacing)) <= math.log(EVAL_SPACING_TOLERANCE):
        return first
    return min(choices, key=lambda c: abs(math.log(c.eval_interval / spacing)))


def match_overrides(mode: str, baseline: RunCost, arm: RunCost) -> tuple[str, ...]:
    """Overrides that give `arm` the baseline's FLOPs (`mode='flops'`) or tokens (`'tokens'`)."""
    if mode == "flops":
        target, per_step = baseline.flops, arm.tokens_per_step * arm.flops_per_token
    elif mode == "tokens":
        target, per_step = baseline.tokens, arm.tokens_per_step
    else:
        raise ValueError(f"match mode must be 'flops' or 'tokens', got {mode!r}")
    fraction = baseline.eval_interval / baseline.steps  # the baseline's spacing, as a share of its run
    matched = matched_steps(target, per_step, fraction * target / per_step)
    extra = (f"train.steps={matched.steps}",)
    return extra + ((f"train.eval_interval={matched.eval_interval}",) if matched.eval_interval else ())


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
