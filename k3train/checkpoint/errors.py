"""`CheckpointError` and the one-line failure descriptions the checkpoint modules put in their messages."""

from __future__ import annotations

import errno
import shutil
from collections.abc import Iterator
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from k3train.errors import UserError

_DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_DISK_FULL_TEXT = ("no space left on device", "disk quota exceeded")


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be used: missing, incomplete, truncated or not matching the model."""


def one_line(e: BaseException, limit: int = 300) -> str:
    """`e`'s message on one line, cut to `limit` characters."""
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _inner_failures(e: BaseException) -> Iterator[BaseException]:
    if isinstance(e, CheckpointException):
        for wrapped in e.failures.values():
            inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
            if isinstance(inner, BaseException):
                yield inner


def describe_failure(e: BaseException) -> str:
    """One line per failure; DCP's CheckpointException (a BaseException) carries one per rank."""
    if isinstance(e, CheckpointException):
        parts = []
        for rank, wrapped in sorted(e.failures.items()):
            inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
            parts.append(f"rank {rank}: {type(inner).__name__}: {one_line(inner, 200)}")
        return "; ".join(parts) or "CheckpointException"
    return f"{type(e).__name__}: {one_line(e)}"


def _causes(e: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    todo: list[BaseException | None] = [e]
    while todo:
        current = todo.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        todo += [current.__cause__, current.__context__, *_inner_failures(current)]


def is_disk_full(e: BaseException) -> bool:
    """Whether `e` (or a cause, or a rank's failure inside DCP's CheckpointException) is a full disk."""
    for cause in _causes(e):
        if isinstance(cause, OSError) and cause.errno in _DISK_FULL_ERRNOS:
            return True
        if any(text in str(cause).lower() for text in _DISK_FULL_TEXT):
            return True
    return False


def free_bytes(directory: Path) -> int | None:
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return None


def describe_save_failure(e: BaseException, directory: Path, needed_bytes: int) -> str:
    """One line for a failed save: a full disk names the directory, the free and needed bytes
    (torch's zip writer reports it as "enforce fail at inline_container.cc", so the free space
    decides too); anything else is `describe_failure`."""
    free = free_bytes(directory)
    if is_disk_full(e) or (free is not None and free < needed_bytes):
        free_text = "unknown" if free is None else f"{free:,}"
        return (
            f"no space left on device in {directory} ({free_text} bytes free, this rank's share of the "
            f"checkpoint needs about {needed_bytes:,} bytes; {describe_failure(e)})"
        )
    return describe_failure(e)
