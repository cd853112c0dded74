"""Optimizer and learning-rate schedule settings (the `optimizer:` and `schedule:` sections)."""

import math
from dataclasses import dataclass
from typing import Literal

from k3train.config.field_ranges import out_of_range
from k3train.config.recipe import ConfigError, check

OPTIMIZER_RANGES = {
    "lr": "non_negative",
    "weight_decay": "non_negative",
    "adam_beta1": "open_fraction",
    "adam_beta2": "open_fraction",
    "adam_eps": "positive",
    "muon_momentum": "open_fraction",
    "muon_ns_steps": "at_least_one",
    "muon_ns_eps": "positive",
    "muon_update_rms": "positive",
    "clip_grad": "non_negative",
}
"""Every numeric optimizer field's range (k3train/config/field_ranges.py kinds)."""


@dataclass
class OptimizerConfig:
    """Per-Head Muon for matrices, AdamW for everything else."""

    name: Literal["muon", "adamw"] = "muon"
    """'muon' (Per-Head Muon + AdamW for vectors, embeddings and head) or 'adamw' for every parameter."""
    lr: float = 3e-3
    """Peak learning rate (shared by Muon and AdamW: Muon's update is scaled to AdamW's RMS)."""
    weight_decay: float = 0.1
    """Decoupled weight decay (not applied to norms, biases and other 1-D parameters)."""
    adam_beta1: float = 0.9
    """AdamW's first-moment decay (Moonlight, K2)."""
    adam_beta2: float = 0.95
    """AdamW's second-moment decay."""
    adam_eps: float = 1e-8
    """AdamW's denominator epsilon."""
    adamw_fused: bool = True
    """Run AdamW (the 'adamw' optimizer and Muon's AdamW groups) through torch's fused kernel,
    one pass per parameter on CPU and CUDA (faster than the for-loop kernel: docs/performance.md);
    false: the for-loop kernel on CPU, foreach on CUDA. The same update up to rounding."""
    muon_momentum: float = 0.95
    """Muon's (Nesterov) momentum."""
    muon_nesterov: bool = True
    """Orthogonalise `G + momentum * M` (Nesterov) instead of the momentum buffer `M`."""
    muon_ns_steps: int = 5
    """Newton–Schulz iterations (quintic, coefficients 3.4445, -4.7750, 2.0315)."""
    muon_ns_eps: float = 1e-7
    """Added to each block's Frobenius norm before Newton–Schulz (a zero gradient stays zero)."""
    muon_update_rms: float = 0.2
    """Update RMS target: each block's update is scaled by muon_update_rms * sqrt(max(rows, cols))."""
    muon_per_head: bool = True
    """Orthogonalise attention projections per head (Per-Head Muon) instead of whole."""
    newton_schulz_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Dtype of the Newton–Schulz iterations: 'auto' is bf16 on CUDA (as Moonlight and
    torch.optim.Muon) and, on a CPU, bf16 for each call at least as large as the crossover this
    machine measured (a probe of about a second timing Newton–Schulz in both dtypes with the
    job's thread count, cached per machine; rank 0's value for every rank), fp32 for smaller
    calls and where bf16 never measured faster; float64 parameters always iterate in float64. bf16 matches fp32 within 5e-2
    norm-wise relative (tools/gpu_check.py)."""
    muon_split_over_dp: bool = True
    """Without ZeRO-1, each data-parallel rank orthogonalises only the Muon matrices it would own
    under ZeRO-1 and the updates are all-gathered (same result, NS work divided by the DP size);
    under ZeRO-1 the owners already split it."""
    clip_grad: float = 1.0
    """Global gradient-norm clipping threshold; 0 disables clipping."""

    def validate(self) -> None:
        """Raise ConfigError naming the first out-of-range field."""
        check(
            [
                (math.isfinite(self.lr), f"optimizer.lr must be a finite number, got {self.lr}"),
                (self.lr >= 0, f"optimizer.lr must not be negative, got {self.lr}"),
            ]
        )
        problem = out_of_range(self, OPTIMIZER_RANGES, "optimizer.")
        if problem is not None:
            raise ConfigError(problem)


@dataclass
class ScheduleConfig:
    """Learning-rate schedule over `train.steps`."""

    name: Literal["cosine", "wsd", "constant"] = "cosine"
    """Warmup then cosine decay; warmup-stable-decay; or warmup then constant."""
    warmup_steps: int = 10
    """Linear warmup from 0 to the peak learning rate."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak."""
    decay_fraction: float = 0.2
    """WSD only: fraction of the steps spent in the final (linear) decay."""

    def validate(self) -> None:
        """Raise ConfigError naming the first out-of-range field."""
        check(
            [
                (self.warmup_steps >= 0, f"schedule.warmup_steps must not be negative, got {self.warmup_steps}"),
                (0 <= self.min_lr_ratio <= 1, f"schedule.min_lr_ratio must lie in [0, 1], got {self.min_lr_ratio}"),
                (
                    0 <= self.decay_fraction <= 1,
                    f"schedule.decay_fraction must lie in [0, 1], got {self.decay_fraction}",
                ),
            ]
        )
