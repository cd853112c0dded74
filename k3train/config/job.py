"""The job's configuration: `JobConfig`, one section per concern, and the rules across sections.

Each section is a dataclass next to the package it configures (`k3train/model/config.py`,
`parallel/config.py`, `k3train/data/config.py`, `k3train/optim/config.py`,
`k3train/training/config.py`, `k3train/checkpoint/config.py`) and checks its own fields in its
`validate`; `JobConfig.validate` adds only the rules that tie sections together. Loading,
overrides and saving are the generic strict recipe machinery of `k3train/config/recipe.py`. Nothing here
imports torch, so `--help`, `--help-config` and config errors answer at once.

    cfg = load_config("recipes/debug.yaml", ["train.steps=5"])
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from k3train.checkpoint.config import CheckpointConfig
from k3train.config import recipe
from k3train.config.recipe import ConfigError
from k3train.data.config import DataConfig
from k3train.model.config import ModelConfig
from k3train.optim.config import OptimizerConfig, ScheduleConfig
from k3train.parallel.config import (
    ModelSplitSizes,
    ParallelConfig,
    check_context_split,
    check_model_split,
    check_overlap_halves,
)
from k3train.parallel.pipeline_schedule import partition_layers
from k3train.training.config import LoggingConfig, TrainConfig

__all__ = [
    "ConfigError",
    "JobConfig",
    "apply_overrides",
    "config_from_dict",
    "config_to_dict",
    "load_config",
    "save_config",
]


@dataclass
class JobConfig:
    """A whole training job: one section per concern, in the order data flows."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The architecture (defaults: the CPU debug model)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """The parallel layout."""
    data: DataConfig = field(default_factory=DataConfig)
    """Datasets, tokenizer and packing."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Per-Head Muon / AdamW settings."""
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """Learning-rate schedule."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The step loop."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Saving and resuming."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metric sinks."""

    def validate(self) -> None:
        """Check every section's own fields, then the rules across sections; raise ConfigError.

        A section's plain ValueError (`ModelConfig.validate` raises those) becomes a ConfigError.
        The rules across sections are the owners' functions, also called at start-up with the
        world size; here they run with what the config alone knows (`parallel.dp=0` counts as 1).
        """
        check_finite_numbers(self)  # before the sections' range checks, which NaN would fail misleadingly
        for section_field in dataclasses.fields(self):
            try:
                getattr(self, section_field.name).validate()
            except ConfigError:
                raise
            except ValueError as error:
                raise ConfigError(str(error)) from None
        model, parallel = self.model, self.parallel
        self.train.micro_batches_per_rank(parallel.dp or 1)
        check_model_split(parallel.tp, parallel.ep, ModelSplitSizes.of(model))
        partition_layers(model.num_hidden_layers, parallel.pp, parallel.virtual_stages, parallel.pipeline_layers)
        check_context_split(
            parallel.cp,
            self.data.seq_length,
            model.linear_attn_config.short_conv_kernel_size,
            parallel.tp,
            parallel.sequence_parallel,
        )
        check_overlap_halves(parallel, self.train.micro_batch_size, model.recompute)


def check_finite_numbers(obj: Any, prefix: str = "") -> None:
    """Raise ConfigError for the first float field, at any depth, that is NaN or infinite: no
    recipe number means "not a number" or "unbounded" (null is how a field says "none")."""
    for item in dataclasses.fields(obj):
        value, dotted = getattr(obj, item.name), f"{prefix}{item.name}"
        if dataclasses.is_dataclass(value):
            check_finite_numbers(value, dotted + ".")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{dotted} must be a finite number, got {value}")
        elif isinstance(value, list) and any(isinstance(v, float) and not math.isfinite(v) for v in value):
            raise ConfigError(f"{dotted} must hold finite numbers, got {value}")


def load_config(recipe_path: str | None, overrides: Sequence[str] = ()) -> JobConfig:
    """Defaults, then the recipe (if any), then the overrides in order; validated.

    Raises ConfigError for a missing or malformed recipe, an unknown key, a value of the wrong
    type or an inconsistent combination of fields.
    """
    return recipe.load_recipe(JobConfig, recipe_path, overrides)


def apply_overrides(cfg: JobConfig, overrides: Sequence[str]) -> JobConfig:
    """A validated copy of cfg with `section.field=value` overrides applied in order."""
    return recipe.with_overrides(cfg, overrides)


def config_from_dict(data: Mapping, source: str = "config") -> JobConfig:
    """A validated JobConfig from a mapping of sections (as `config_to_dict` writes); fields left
    out keep their defaults. `source` names the origin in error messages."""
    return recipe.from_mapping(JobConfig, data, source)


def config_to_dict(cfg: JobConfig) -> dict[str, Any]:
    """The resolved config as nested builtins (sections → fields), loadable by `config_from_dict`."""
    return recipe.to_mapping(cfg)


def save_config(cfg: JobConfig, path: str) -> None:
    """Write the resolved config as a YAML recipe (atomically: a reader never sees half a file)."""
    recipe.save_recipe(cfg, path, header="# Resolved k3train config (every field); rerun with --recipe this_file.\n")
