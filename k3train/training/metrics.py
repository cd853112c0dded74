"""Metric sinks: the console step line, RUN_DIR/metrics.jsonl, and optional TensorBoard and wandb.

Optional sinks are imported only when enabled; wandb runs offline unless the recipe says
otherwise (`logging.wandb_mode`).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from k3train.config import JobConfig
from k3train.errors import UserError


def format_step_line(metrics: dict[str, Any], total_steps: int, mfu_label: str) -> str:
    parts = [
        f"step {metrics['step']}/{total_steps}",
        f"loss {metrics['loss']:.4f}",
        f"grad_norm {metrics['grad_norm']:.3g}",
        f"lr {metrics['lr']:.2e}",
        f"tok/s {metrics['tokens_per_s']:,.0f}",
        f"TFLOP/s {metrics['tflops']:.3g}",
        f"{mfu_label} {100 * metrics['mfu']:.1f}%",
    ]
    if metrics.get("optimizer_share") is not None:  # optimizer time; Newton–Schulz FLOPs are not in MFU
        newton_schulz = (
            f" (NS {metrics['newton_schulz_gflop']:.3g} GFLOP)" if metrics.get("newton_schulz_gflop") else ""
        )
        parts.append(f"opt {100 * metrics['optimizer_share']:.1f}%{newton_schulz}")
    if metrics.get("expert_load_max_over_mean") is not None:
        parts.append(f"expert load max/mean {metrics['expert_load_max_over_mean']:.2f}")
        parts.append(f"dropped {metrics['dropped_tokens']}")
        if metrics.get("ep_token_bytes"):  # expert parallelism: replicas and bytes on the wire per rank
            parts.append(f"replicas {metrics['replicas_placed']:.0f}")
            parts.append(
                f"EP wire {metrics['ep_token_bytes'] / 2**20:.2f}+{metrics['ep_replica_bytes'] / 2**20:.2f} MiB"
            )
    exposed = metrics.get("exposed_comm_s") or {}
    if exposed:  # the seconds this rank waited in collectives: communication nothing hid
        worst = max(exposed, key=exposed.__getitem__)
        share = 100 * metrics["exposed_comm_total_s"] / metrics["step_time_s"]
        parts.append(f"comm {share:.1f}% ({worst} {100 * exposed[worst] / metrics['step_time_s']:.1f}%)")
    if metrics.get("skipped_steps"):
        parts.append(f"skipped {metrics['skipped_steps']}")
    per_rank = metrics.get("memory_gib_per_rank") or []
    if len(per_rank) > 1:  # the largest rank, and the spread across ranks
        parts.append(f"mem {max(per_rank):.2f} GiB max/rank (min {min(per_rank):.2f})")
    else:
        parts.append(f"mem {metrics['memory_gib']:.2f} GiB")
    parts.append(f"eta {metrics['eta']}")
    return " | ".join(parts)


class SinkError(UserError, RuntimeError):
    """An enabled metric sink cannot start (its package is missing); the message says the fix."""


def require_sinks(config: JobConfig) -> None:
    """Check that the enabled optional sinks can be imported. Every rank calls it (only rank 0
    logs), so a missing package stops all ranks at start-up instead of leaving them waiting."""
    wanted = []
    if config.logging.tensorboard:
        wanted.append(("tensorboard", "torch.utils.tensorboard", "tensorboard"))
    if config.logging.wandb and config.logging.wandb_mode != "disabled":
        wanted.append(("wandb", "wandb", "wandb"))
    for field, module, package in wanted:
        try:
            __import__(module)
        except ImportError as error:
            raise SinkError(
                f"logging.{field}=true needs the {package} package: pip install {package} "
                f"(or set logging.{field}=false)"
            ) from error


class MetricsLogger:
    """Writes every logged step to the enabled sinks; only global rank 0 of a job owns one."""

    def __init__(self, config: JobConfig, run_dir: Path, mfu_label: str):
        self.total_steps = config.train.steps
        self.mfu_label = mfu_label
        self.jsonl = open(run_dir / "metrics.jsonl", "a") if config.logging.jsonl else None
        require_sinks(config)
        self.tensorboard = None
        if config.logging.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        self.wandb_run = None
        if config.logging.wandb and config.logging.wandb_mode != "disabled":
            import wandb

            self.wandb_run = wandb.init(
                project=config.logging.wandb_project,
                mode=config.logging.wandb_mode,
                dir=str(run_dir),
                config=_json_safe(config),
            )

    def log_step(self, metrics: dict[str, Any]) -> None:
        print(format_step_line(metrics, self.total_steps, self.mfu_label), flush=True)
        self._write(metrics)

    def log_validation(self, step: int, loss: float) -> None:
        print(f"validation at step {step} | loss {loss:.4f} | ppl {math.exp(min(loss, 50)):.2f}", flush=True)
        self._write({"step": step, "validation_loss": loss})

    def _write(self, metrics: dict[str, Any]) -> None:
        if self.jsonl is not None:  # strict JSON: a NaN (e.g. an empty validation split) is null
            clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}
            self.jsonl.write(json.dumps(clean) + "\n")
            self.jsonl.flush()
        scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and k != "step"}
        if self.tensorboard is not None:
            for key, value in scalars.items():
                self.tensorboard.add_scalar(key, value, metrics["step"])
        if self.wandb_run is not None:
            self.wandb_run.log(scalars, step=metrics["step"])

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()


def _json_safe(config: JobConfig) -> dict:
    from k3train.config import config_to_dict

    return config_to_dict(config)


def warn(message: str, stream: Any | None = None) -> None:
    print(f"warning: {message}", file=stream or sys.stderr, flush=True)
