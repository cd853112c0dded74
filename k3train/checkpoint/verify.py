"""Is a directory a usable checkpoint? `checkpoint_problems` lists every problem (one line each,
with a short reason used to name a damaged checkpoint moved aside); `verify_checkpoint` raises the
first as a `CheckpointError`. Nothing here loads a model or runs code from the files."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TypeGuard

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from k3train.checkpoint.containment import escapes
from k3train.checkpoint.errors import CheckpointError
from k3train.checkpoint.integrity import CHECKSUM, file_checksum
from k3train.checkpoint.manifest import MANIFEST, METADATA, manifest_problem, read_manifest, resume_hint
from k3train.checkpoint.safe_metadata import read_metadata_safely

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Problem:
    """One reason a checkpoint cannot be used."""

    reason: str
    """A short word: missing, outside, incomplete, manifest, metadata, truncated, checksum."""
    message: str
    """One line naming the checkpoint and what is wrong."""


@dataclass
class Verdict:
    """What `checkpoint_problems` found: the metadata (None if unreadable) and the problems."""

    metadata: Metadata | None
    problems: list[Problem]
    checksummed: bool
    """Whether the manifest lists checksums (checkpoints of k3train before format 2 do not)."""


def checkpoint_problems(path: str | Path, checksums: bool = True, share: tuple[int, int] = (0, 1)) -> Verdict:
    """Check `path`: manifest marked complete, `.metadata` readable (allow-listed), every data file
    it names present and long enough, and (with `checksums`) every file in the manifest's list
    with its recorded size and checksum. `share=(i, n)` checks only the i-th of every n files (ranks
    split the reading); the cheap checks are always done in full."""
    path = Path(path)
    if not path.exists():
        return Verdict(None, [Problem("missing", f"checkpoint {path} does not exist")], False)
    if not path.is_dir():
        return Verdict(None, [Problem("missing", f"checkpoint {path} is not a directory")], False)
    problems: list[Problem] = []
    if path.is_symlink() and escapes(path.parent, path) is not None:
        message = (
            f"checkpoint {path} is a link to {path.resolve()}, outside {path.parent}; "
            "pass the checkpoint's real path, or copy it in"
        )
        return Verdict(None, [Problem("outside", message)], False)
    for name in (MANIFEST, METADATA):
        outside = escapes(path, path / name)
        if outside is not None:
            message = f"checkpoint {path}: {name} leads outside the checkpoint (to {outside})"
            return Verdict(None, [Problem("outside", message)], False)
    manifest = read_manifest(path)
    if not (path / METADATA).is_file():
        problems.append(
            Problem("incomplete", f"checkpoint {path} is incomplete: no {METADATA} (its save did not finish)")
        )
    if not manifest or manifest.get("complete") is not True:
        problems.append(
            Problem(
                "incomplete",
                f"checkpoint {path} is incomplete: no {MANIFEST} marked complete (its save did not finish)",
            )
        )
    if problems:
        return Verdict(None, problems, False)
    assert manifest is not None  # a missing manifest is a problem above
    damage = manifest_problem(manifest)
    if damage is not None:
        return Verdict(None, [Problem("manifest", f"checkpoint {path} is damaged: {damage}")], False)
    try:
        metadata = read_metadata_safely(path)
    except CheckpointError as e:
        return Verdict(None, [Problem("metadata", str(e))], False)

    declared = _declared_size_problem(metadata)
    if declared is not None:
        return Verdict(None, [Problem("metadata", f"checkpoint {path}: {METADATA} {declared}")], False)
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if rel is None:
            continue
        end = int(getattr(info, "offset", 0)) + int(getattr(info, "length", 0))
        needed[str(rel)] = max(needed.get(str(rel), 0), end)
    for rel, size in sorted(needed.items()):
        file = path / rel
        if not _inside(path, file):
            problems.append(
                Problem("metadata", f"checkpoint {path}: {METADATA} names a file outside the checkpoint ({rel})")
            )
        elif not file.is_file():
            problems.append(Problem("incomplete", f"checkpoint {path} is incomplete: data file {rel} is missing"))
        elif file.stat().st_size < size:
            problems.append(
                Problem(
                    "truncated",
                    f"checkpoint {path} is truncated: data file {rel} has {file.stat().st_size} "
                    f"bytes, {METADATA} needs {size}",
                )
            )

    files = manifest.get("files")
    checksummed = isinstance(files, dict)
    if checksums and isinstance(files, dict) and not problems:
        uncovered = sorted(set(needed) - set(files))
        if uncovered:
            problems.append(
                Problem("checksum", f"checkpoint {path}: {MANIFEST} has no checksum for {', '.join(uncovered[:3])}")
            )
        index, count = share
        for rel in sorted(files)[index::count]:
            problems += _check_file(path, rel, files[rel])
    return Verdict(metadata, problems, checksummed)


def _whole(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _declared_size_problem(metadata: Metadata) -> str | None:
    """What is impossible in the sizes `.metadata` declares, before anything is allocated from
    them: each tensor's chunks lie inside it and cover it exactly, and each chunk's stored bytes
    are at least its elements' (the data files are then checked to hold those bytes), so a
    declared size no file backs is refused here, not met as a terabyte allocation."""
    storage = metadata.storage_data or {}
    for fqn, md in (metadata.state_dict_metadata or {}).items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        size = tuple(md.size)
        dtype = getattr(md.properties, "dtype", None)
        if not all(_whole(s) for s in size) or not isinstance(dtype, torch.dtype):
            return f"declares tensor {fqn} with size {list(size)} and dtype {dtype!r}"
        covered = 0
        for index, chunk in enumerate(md.chunks):
            offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
            if len(offsets) != len(size) or len(sizes) != len(size):
                return f"declares a chunk of tensor {fqn} with {len(sizes)} dimensions, the tensor has {len(size)}"
            if not all(_whole(o) and _whole(n) and o + n <= s for o, n, s in zip(offsets, sizes, size, strict=True)):
                return f"declares a chunk of tensor {fqn} (offsets {list(offsets)}, sizes {list(sizes)}) outside its size {list(size)}"
            elements = math.prod(sizes)
            covered += elements
            info = storage.get(MetadataIndex(fqn, offsets, index)) or storage.get(MetadataIndex(fqn, offsets))
            length = getattr(info, "length", None)
            if info is None or not _whole(length) or not _whole(getattr(info, "offset", None)):
                return f"names no stored bytes for a chunk of tensor {fqn} (offsets {list(offsets)})"
            item_size = torch.empty((), dtype=dtype).element_size()
            if length < elements * item_size:
                return (
                    f"declares tensor {fqn} chunk {list(sizes)} ({elements * item_size:,} bytes) stored in "
                    f"{length:,} bytes"
                )
        if covered != math.prod(size):
            return f"declares tensor {fqn} of size {list(size)} whose chunks hold {covered:,} of its {math.prod(size):,} elements"
    return None


def _inside(root: Path, file: Path) -> bool:
    return escapes(root, file) is None


def _check_file(path: Path, rel: str, recorded: object) -> list[Problem]:
    file = path / rel
    if not isinstance(recorded, dict) or not _inside(path, file):
        return [Problem("checksum", f"checkpoint {path}: {MANIFEST} has an invalid entry for {rel!r}")]
    if not file.is_file():
        return [Problem("incomplete", f"checkpoint {path} is incomplete: {rel} is missing")]
    actual = file_checksum(file)
    if actual["size"] != recorded.get("size"):
        return [
            Problem(
                "truncated",
                f"checkpoint {path}: {rel} has {actual['size']} bytes, the manifest recorded {recorded.get('size')}",
            )
        ]
    if actual[CHECKSUM] != recorded.get(CHECKSUM):
        return [
            Problem(
                "checksum",
                f"checkpoint {path}: {rel} is damaged ({CHECKSUM} {actual[CHECKSUM]}, the "
                f"manifest recorded {recorded.get(CHECKSUM)})",
            )
        ]
    return []


def verify_checkpoint(path: str | Path, checksums: bool = True, share: tuple[int, int] = (0, 1)) -> Metadata:
    """Check `path` (see `checkpoint_problems`) and return its DCP metadata; raise `CheckpointError`
    with the first problem and what to do otherwise."""
    path = Path(path)
    verdict = checkpoint_problems(path, checksums, share)
    if verdict.problems:
        first = verdict.problems[0]
        if first.reason == "missing":
            raise CheckpointError(
                f"{first.message}; pass checkpoint.resume=<a complete checkpoint directory>, auto (newest in "
                "checkpoint.dir) or none"
            )
        more = f" (and {len(verdict.problems) - 1} more problem(s))" if len(verdict.problems) > 1 else ""
        raise CheckpointError(f"{first.message}{more}; {resume_hint(path)}")
    if checksums and not verdict.checksummed:
        logger.warning("checkpoint %s has no checksums (written before k3train recorded them): not verified", path)
    assert verdict.metadata is not None
    return verdict.metadata
