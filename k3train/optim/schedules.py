"""Learning-rate schedules as pure functions of the step index, so a resumed run computes exactly
the lr it would have had (nothing to checkpoint).

Convention: `step` is the 0-based index of the optimizer step about to be taken; step `s` uses
the lr for `n = s + 1` completed steps (as Megatron's scheduler does), so the first step trains
with `peak / warmup_steps` rather than zero, step `warmup_steps - 1` with the peak, and the last
step (`total_steps - 1`) with the final lr `min_lr_ratio * peak`.
"""

import math

import torch

from k3train.optim.config import ScheduleConfig


def lr_at(step: int, schedule: ScheduleConfig, peak_lr: float, total_steps: int) -> float:
    """The learning rate for 0-based optimizer step `step` of a `total_steps`-step run.

    - warmup (all schedules): linear, `peak * n / warmup_steps` for `n <= warmup_steps`;
    - "cosine": half a cosine from the peak (at `n = warmup_steps`) to `min_lr_ratio * peak`
      (at `n = total_steps`);
    - "wsd": the peak until the last `decay_fraction` of the steps, then linear to the minimum;
    - "constant": the peak.
    Past `total_steps` the lr stays at its final value.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    n = step + 1
    warmup = max(schedule.warmup_steps, 0)
    if n <= warmup:
        return peak_lr * n / warmup
    min_lr = schedule.min_lr_ratio * peak_lr
    if schedule.name == "constant":
        return peak_lr
    if schedule.name == "cosine":
        progress = _fraction(n - warmup, total_steps - warmup)
        return min_lr + (peak_lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule.name == "wsd":
        decay_steps = round(schedule.decay_fraction * total_steps)
        decay_start = max(total_steps - decay_steps, warmup)
        if n <= decay_start:
            return peak_lr
        return peak_lr + (min_lr - peak_lr) * _fraction(n - decay_start, total_steps - decay_start)
    raise ValueError(f"unknown schedule {schedule.name!r} (cosine, wsd or constant)")


def _fraction(done: int, span: int) -> float:
    """`done / span` clipped to [0, 1]; an empty span counts as finished."""
    return 1.0 if span <= 0 else min(max(done / span, 0.0), 1.0)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Write `lr` into every param group (Muon and AdamW share one lr)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
