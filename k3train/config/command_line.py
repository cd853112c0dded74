"""The job's command line: `[--recipe YAML] [--run-dir DIR] [--help-config] [section.field=value ...]`.

cfg, run_dir = parse_job_args(["--recipe", "recipes/debug.yaml", "train.steps=5"])
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from k3train.config import ConfigError, JobConfig, load_config
from k3train.config.reference import config_reference_markdown
from k3train.job.ending import exit_same_on_every_rank

__all__ = ["parse_job_args", "parse_job_args_or_exit"]


def _argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pretrain_k3.py",
        description="Pretrain a K3-style model. Settings come from the defaults, then the recipe, "
        "then section.field=value overrides (see --help-config).",
    )
    parser.add_argument(
        "--recipe",
        metavar="YAML",
        default=None,
        help="recipe file (e.g. recipes/debug.yaml); without one the defaults are used",
    )
    parser.add_argument(
        "--run-dir", metavar="DIR", default=None, help="directory for logs, metrics and (by default) checkpoints"
    )
    parser.add_argument(
        "--help-config",
        action="store_true",
        help="print every config field with its type, default and meaning, and exit",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="section.field=value",
        help="override a config field, e.g. train.steps=50 optimizer.lr=3e-4",
    )
    return parser


def parse_job_args(argv: Sequence[str] | None = None) -> tuple[JobConfig, str | None]:
    """Parse `[--recipe YAML] [--run-dir DIR] [section.field=value ...]` into a validated config and
    the run directory (None if not given).

    `--help-config` prints the field reference and exits 0; bad flags exit 2 as argparse does;
    a bad recipe or override raises ConfigError (see `parse_job_args_or_exit`).
    """
    parser = _argument_parser()
    # Intermixed: overrides may come before or after --run-dir / --recipe.
    args = parser.parse_intermixed_args(list(sys.argv[1:] if argv is None else argv))
    if args.help_config:
        print(config_reference_markdown())
        parser.exit(0)
    return load_config(args.recipe, args.overrides), args.run_dir


def parse_job_args_or_exit(argv: Sequence[str] | None = None) -> tuple[JobConfig, str | None]:
    """`parse_job_args` for a script's main(): a ConfigError becomes one line on stderr and exit 2."""
    try:
        return parse_job_args(argv)
    except ConfigError as error:  # under torchrun every rank fails alike: rank 0 prints, once
        exit_same_on_every_rank(f"pretrain_k3.py: config error: {error}", 2)
