"""Checkpoint directory layout (`step_NNNNNNNN`, `.tmp_`/`.old_` prefixes, `.damaged-` suffixes) and
the `k3train.json` manifest (with every file's checksum). `verify.py` checks a directory against it."""

from __future__ import annotations

import datetime
import json
import os
import re
import time
from pathlib import Path
from typing import Any

import torch

from k3train.checkpoint.bounded_json import json_file
from k3train.checkpoint.integrity import CHECKSUM, checksum_files

MANIFEST = "k3train.json"
METADATA = ".metadata"
FORMAT = "k3train-dcp"
FORMAT_VERSION = 2
"""2: non-tensor values as JSON (`values.py`) and a checksum per file in the manifest."""
MANIFEST_MAX_BYTES = 64 << 20
"""A manifest lists one checksum per file (about 100 bytes each): 64 MiB is far above any real one."""
STEP_PREFIX = "step_"
TMP_PREFIX = ".tmp_"
OLD_PREFIX = ".old_"
_STEP_RE = re.compile(r"^step_(\d+)$")
_OLD_RE = re.compile(r"^\.old_(step_\d+)_[0-9a-f]+$")
DAMAGED_INFIX = ".damaged-"
"""`step_00000010.damaged-checksum`: a checkpoint moved aside, never listed, pruned or overwritten."""


def step_dir_name(step: int) -> str:
    """`step_00000010` for step 10 (eight digits, more when the step needs them)."""
    if step < 0:
        raise ValueError(f"step must be >= 0 (got {step})")
    return f"{STEP_PREFIX}{step:08d}"


def step_of(name: str) -> int | None:
    """The step of a checkpoint directory name (`step_00000010` → 10), None for any other name."""
    match = _STEP_RE.match(name)
    return int(match.group(1)) if match else None


def replaced_step_name(name: str) -> str | None:
    """The final name (`step_NNNNNNNN`) an `.old_` directory was moved aside from, else None."""
    match = _OLD_RE.match(name)
    return match.group(1) if match else None


def complete_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """The complete checkpoints directly below `root` as (step, path), oldest step first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        step = step_of(entry.name)
        if step is not None and entry.is_dir() and is_complete(entry):
            found.append((step, entry))
    return sorted(found)


def read_manifest(path: str | Path) -> dict | None:
    """The manifest of a checkpoint directory, or None when it is missing or unreadable."""
    try:
        manifest = json_file(Path(path) / MANIFEST, MANIFEST_MAX_BYTES)
    except (OSError, ValueError):  # UnicodeDecodeError, too large or too deep included
        return None
    return manifest if isinstance(manifest, dict) else None


def is_complete(path: str | Path) -> bool:
    """True when `path` holds DCP's `.metadata` and a manifest marked complete (cheap: no data read)."""
    path = Path(path)
    if not (path / METADATA).is_file():
        return False
    manifest = read_manifest(path)
    return bool(manifest and manifest.get("complete") is True)


def manifest_problem(manifest: dict) -> str | None:
    """What is wrong with a complete manifest's own fields, by its format version (None: fine).
    Every version k3train wrote names itself; from version 2 on the checksums are part of the
    format, so a version-2 manifest without them is damage, not an older checkpoint."""
    version = manifest.get("version")
    if manifest.get("format") != FORMAT:
        return f"its {MANIFEST} has format {manifest.get('format')!r}, not {FORMAT!r}"
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        return f"its {MANIFEST} has no valid format version ({version!r})"
    if version > FORMAT_VERSION:
        return f"its {MANIFEST} is format version {version}, newer than this k3train reads ({FORMAT_VERSION}): upgrade k3train"
    step = manifest.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return f"its {MANIFEST} has step {step!r}, not a non-negative whole number"
    if version >= 2 and not isinstance(manifest.get("files"), dict):
        return f"its {MANIFEST} (format version {version}) has lost its list of file checksums"
    return None


def write_manifest(path: str | Path, step: int, world_size: int = 1, **extra: Any) -> None:
    """Write `k3train.json` into a finished DCP directory (atomically, fsynced).

    `Checkpointer.save` calls this with the checksums its ranks computed; a converter that writes
    a DCP checkpoint by other means calls it last, without `files`, and every file in the
    directory is checksummed here.
    """
    path = Path(path)
    if "files" not in extra:  # a version-2 manifest always lists its files' checksums
        names = sorted(
            str(f.relative_to(path)) for f in path.rglob("*") if f.is_file() and not f.name.startswith(MANIFEST)
        )
        extra.update(checksum=CHECKSUM, files=checksum_files(path, names))
    now = time.time()
    manifest = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "step": int(step),
        "time": datetime.datetime.fromtimestamp(now, datetime.UTC).isoformat(),
        "unix_time": now,
        "torch_version": torch.__version__,
        "world_size": int(world_size),
        **extra,
        "complete": True,
    }
    tmp = path / (MANIFEST + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path / MANIFEST)
    fsync_dir(path)


def resume_hint(path: Path) -> str:
    """What to do about the unusable checkpoint `path` (the tail of an error message)."""
    return f"delete {path} or pass checkpoint.resume=<another checkpoint> (or checkpoint.resume=none)"


def move_aside(path: Path, reason: str) -> Path:
    """Rename the unusable checkpoint `path` to `<name>.damaged-<reason>[-n]` (never over anything)
    and return the new path; it keeps every byte for inspection and is no longer a checkpoint."""
    base = path.with_name(f"{path.name}{DAMAGED_INFIX}{reason}")
    target, n = base, 1
    while target.exists():
        n += 1
        target = base.with_name(f"{base.name}-{n}")
    os.replace(path, target)
    fsync_dir(path.parent)
    return target


def damaged_checkpoints(root: str | Path) -> list[Path]:
    """Directories below `root` that were moved aside as damaged, by name."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.name.startswith(STEP_PREFIX) and DAMAGED_INFIX in p.name)


def fsync_dir(path: Path) -> None:
    """Make renames and new entries in directory `path` durable (best effort)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
