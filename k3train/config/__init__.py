"""The job's configuration and the machinery that loads it.

- `job.py`: `JobConfig`, one section per concern, and the rules across sections.
- `recipe.py`: strict YAML recipes for any dataclass tree: loading, `key=value` overrides, saving.
- `typed_fields.py`: field types, attribute docstrings and the coercion of YAML values.
- `reference.py`: the Markdown reference of every field (`docs/config.md`, `--help-config`).
- `command_line.py`: the job's command line.

Nothing here imports torch, so `--help`, `--help-config` and config errors answer at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from k3train.lazy_exports import lazy_exports

if TYPE_CHECKING:  # static tools and IDEs see the real imports
    from k3train.config.job import (
        ConfigError,
        JobConfig,
        apply_overrides,
        config_from_dict,
        config_to_dict,
        load_config,
        save_config,
    )

# Loaded on first use: the sections' own modules (`k3train/parallel/config.py`, ...) import
# `k3train.config.recipe`, which must not pull in `job.py` (and through it those sections) first.
_SUBMODULE_OF = {
    "ConfigError": "k3train.config.job",
    "JobConfig": "k3train.config.job",
    "apply_overrides": "k3train.config.job",
    "config_from_dict": "k3train.config.job",
    "config_to_dict": "k3train.config.job",
    "load_config": "k3train.config.job",
    "save_config": "k3train.config.job",
}

__all__ = [
    "ConfigError",
    "JobConfig",
    "apply_overrides",
    "config_from_dict",
    "config_to_dict",
    "load_config",
    "save_config",
]

__getattr__, __dir__ = lazy_exports(__name__, _SUBMODULE_OF)
