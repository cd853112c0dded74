#!/usr/bin/env python
"""Check k3train checkpoints without loading a model: the manifest is complete, `.metadata` is
readable through the allow-listed unpickler, every data file is present and long enough, and every
file matches the size and CRC-32 the manifest recorded.

    python tools/verify_checkpoint.py RUN_DIR/checkpoints/step_00001000
    python tools/verify_checkpoint.py RUN_DIR/checkpoints      # every step_NNNNNNNN below it
    python tools/verify_checkpoint.py RUN_DIR                  # the same, below RUN_DIR/checkpoints

Prints one line per problem (and one `ok` line per good checkpoint); exit status 0 when every
checkpoint checked is good, 1 otherwise, 2 when PATH holds no checkpoint.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from collections.abc import Sequence

from k3train.path_arguments import PathArgument, exit_if_a_path_is_missing

PATH_ARGUMENTS = (
    PathArgument(
        "", "pass a checkpoint (RUN_DIR/checkpoints/step_NNNNNNNN), a checkpoints/ directory or a run directory"
    ),
)
if __name__ == "__main__":  # before torch loads (seconds; far more on a cold disk): a wrong path answers at once
    exit_if_a_path_is_missing(sys.argv[1:], PATH_ARGUMENTS)

from k3train.checkpoint.manifest import MANIFEST, METADATA, damaged_checkpoints, step_of  # noqa: E402
from k3train.checkpoint.verify import checkpoint_problems  # noqa: E402


def checkpoints_under(path: pathlib.Path) -> list[pathlib.Path]:
    """The checkpoint directories PATH names: itself, or the step directories below it (or below
    PATH/checkpoints)."""
    if (path / MANIFEST).exists() or (path / METADATA).exists() or step_of(path.name) is not None:
        return [path]
    for root in (path, path / "checkpoints"):
        steps = sorted(p for p in root.iterdir() if p.is_dir() and step_of(p.name) is not None) if root.is_dir() else []
        if steps:
            return steps
    return []


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="verify_checkpoint.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="a checkpoint, a checkpoint directory or a run directory")
    parser.add_argument("--no-checksums", action="store_true", help="skip reading the data (sizes and metadata only)")
    args = parser.parse_args(argv)
    path = pathlib.Path(args.path).expanduser()
    if not path.exists():
        print(f"error: {path} does not exist", file=sys.stderr)
        return 2
    found = checkpoints_under(path)
    if not found:
        print(f"error: {path} holds no k3train checkpoint (step_NNNNNNNN directories)", file=sys.stderr)
        return 2
    bad = 0
    for checkpoint in found:
        verdict = checkpoint_problems(checkpoint, checksums=not args.no_checksums)
        for problem in verdict.problems:
            print(f"{problem.reason}: {problem.message}")
        if verdict.problems:
            bad += 1
            continue
        what = (
            "sizes checked"
            if args.no_checksums
            else (
                "checksums verified" if verdict.checksummed else "no checksums recorded (older k3train): sizes checked"
            )
        )
        print(f"ok: {checkpoint} ({what})")
    if found[0] != path:  # a directory of checkpoints: mention those moved aside
        for aside in damaged_checkpoints(found[0].parent):
            print(f"note: {aside} was moved aside as damaged (not checked)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
