"""The paths a tool's command line names, checked before the tool imports torch.

Importing torch and the model code takes seconds, and tens of seconds on a cold disk or a
network file system: a mistyped `--load` should answer at once. A tool lists its path
arguments (`PathArgument`) and, run as a script, calls `exit_if_a_path_is_missing(sys.argv[1:],
...)` before its heavy imports: one line naming the option, the path and the fix, status 2. The
scan reads `--option value` and `--option=value` only (argparse's abbreviations pass through,
and the tool's own checks still catch those, later); `-h`/`--help` skips it. Stdlib only.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["PathArgument", "exit_if_a_path_is_missing", "missing_path"]

MISSING_PATH = 2
"""The tools' exit status for an argument error."""


@dataclass(frozen=True)
class PathArgument:
    """A command-line argument that names something that must exist."""

    option: str
    """`--load`; the empty string means the first positional argument."""
    fix: str
    """What to pass instead, e.g. "pass a step_NNNNNNNN directory or a run directory"."""
    subcommand: str | None = None
    """Only after this subcommand (the first argument), e.g. convert_checkpoint's `from-hf`."""
    contains: str | None = None
    """A file the named directory must hold (a Hugging Face directory's `config.json`)."""
    not_paths: frozenset[str] = field(default_factory=frozenset)
    """Values that name no file (`--tokenizer byte`)."""
    several: bool = False
    """The option takes one or more values (argparse's `nargs="+"`)."""


def _values(argv: Sequence[str], argument: PathArgument) -> list[str]:
    """The values `argument` has in `argv` (every occurrence)."""
    if not argument.option:
        first = next((token for token in argv if not token.startswith("-")), None)
        return [first] if first is not None else []
    values: list[str] = []
    for index, token in enumerate(argv):
        if token.startswith(argument.option + "="):
            values.append(token.split("=", 1)[1])
        elif token == argument.option:
            following = argv[index + 1 :]
            taken: list[str] = []
            for value in following:
                if value.startswith("--") or (taken and not argument.several):
                    break
                taken.append(value)
            values.extend(taken)
    return values


def missing_path(argv: Sequence[str], arguments: Sequence[PathArgument]) -> str | None:
    """The line for the first named path that does not exist (or lacks `contains`), else None."""
    if "-h" in argv or "--help" in argv:
        return None
    for argument in arguments:
        if argument.subcommand is not None and (not argv or argv[0] != argument.subcommand):
            continue
        name = argument.option or "path"
        for value in _values(argv, argument):
            if value in argument.not_paths:
                continue
            path = Path(value).expanduser()
            if not path.exists():
                return f"{name} {value} does not exist; {argument.fix}"
            if argument.contains and not (path / argument.contains).is_file():
                return f"{name} {value} has no {argument.contains}; {argument.fix}"
    return None


def exit_if_a_path_is_missing(argv: Sequence[str], arguments: Sequence[PathArgument], prefix: str = "error: ") -> None:
    """One line on stderr and exit status 2 when `missing_path` finds one."""
    problem = missing_path(argv, arguments)
    if problem is not None:
        print(f"{prefix}{problem}", file=sys.stderr)
        raise SystemExit(MISSING_PATH)
