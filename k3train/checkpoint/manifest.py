"""Checkpoint directory layout (`step_XXXXXXXX`, `.tmp_`/`.old_` prefixes), the `k3train.json`
manifest, and verification that a directory is a complete, untruncated checkpoint."""

from __future__ import annotations

import datetime
import json
import os
import re
import time
from pathlib import Path
from typing import Any, Optional

import torch
from torch.distributed.checkpoint.metadata import Metadata

from k3train.checkpoint.errors import CheckpointError
from k3train.checkpoint.safe_metadata import read_metadata_safely

MANIFEST = "k3train.json"
METADATA = ".metadata"
FORMAT = "k3train-dcp"
FORMAT_VERSION = 1
STEP_PREFIX = "step_"
TMP_PREFIX = ".tmp_"
OLD_PREFIX = ".old_"
_STEP_RE = re.compile(r"^step_(\d+)$")
_OLD_RE = re.compile(r"^\.old_(step_\d+)_[0-9a-f]+$")


def step_dir_name(step: int) -> str:
    """`step_00000010` for step 10 (eight digits, more when the step needs them)."""
    if step < 0:
        raise ValueError(f"step must be >= 0 (got {step})")
    return f"{STEP_PREFIX}{step:08d}"


def step_of(name: str) -> Optional[int]:
    """The step of a checkpoint directory name (`step_00000010` → 10), None for any other name."""
    match = _STEP_RE.match(name)
    return int(match.group(1)) if match else None


def replaced_step_name(name: str) -> Optional[str]:
    """The final name (`step_XXXXXXXX`) an `.old_` directory was moved aside from, else None."""
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


def read_manifest(path: str | Path) -> Optional[dict]:
    """The manifest of a checkpoint directory, or None when it is missing or unreadable."""
    try:
        with open(Path(path) / MANIFEST, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def is_complete(path: str | Path) -> bool:
    """True when `path` holds DCP's `.metadata` and a manifest marked complete (cheap: no data read)."""
    path = Path(path)
    if not (path / METADATA).is_file():
        return False
    manifest = read_manifest(path)
    return bool(manifest and manifest.get("complete") is True)


def write_manifest(path: str | Path, step: int, world_size: int = 1, **extra: Any) -> None:
    """Write `k3train.json` into a finished DCP directory (atomically, fsynced).

    `Checkpointer.save` calls this; a converter that writes a DCP checkpoint by other means calls
    it last to make the directory a complete checkpoint.
    """
    path = Path(path)
    now = time.time()
    manifest = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "step": int(step),
        "time": datetime.datetime.fromtimestamp(now, datetime.timezone.utc).isoformat(),
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


def verify_checkpoint(path: str | Path) -> Metadata:
    """Check that `path` is a complete, untruncated checkpoint; return its DCP metadata.

    Reads `.metadata` and compares every data file it names with the bytes it needs (missing and
    short files are found here, before DCP reads anything). Raises `CheckpointError`.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(
            f"checkpoint {path} does not exist; pass checkpoint.resume=<a complete checkpoint "
            "directory>, auto (newest in checkpoint.dir) or none"
        )
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} is not a directory; {resume_hint(path)}")
    if not (path / METADATA).is_file():
        raise CheckpointError(
            f"checkpoint {path} is incomplete: no {METADATA} (its save did not finish); {resume_hint(path)}"
        )
    manifest = read_manifest(path)
    if not manifest or manifest.get("complete") is not True:
        raise CheckpointError(
            f"checkpoint {path} is incomplete: no {MANIFEST} marked complete (its save did not "
            f"finish); {resume_hint(path)}"
        )
    try:
        metadata = read_metadata_safely(path)  # allow-listed: a crafted .metadata cannot run code
    except CheckpointError as e:
        raise CheckpointError(f"{e}; {resume_hint(path)}") from None
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if rel is None:
            continue
        end = int(getattr(info, "offset", 0)) + int(getattr(info, "length", 0))
        needed[rel] = max(needed.get(rel, 0), end)
    for rel, size in sorted(needed.items()):
        file = path / rel
        if not file.is_file():
            raise CheckpointError(
                f"checkpoint {path} is incomplete: data file {rel} is missing; {resume_hint(path)}"
            )
        actual = file.stat().st_size
        if actual < size:
            raise CheckpointError(
                f"checkpoint {path} is truncated: data file {rel} has {actual} bytes, "
                f"{METADATA} needs {size}; {resume_hint(path)}"
            )
    return metadata


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
