"""`CheckpointError` and the one-line failure descriptions the checkpoint modules put in their messages."""

from __future__ import annotations

from torch.distributed.checkpoint.api import CheckpointException


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: missing, incomplete, truncated or not matching the model."""


def one_line(e: BaseException, limit: int = 300) -> str:
    """`e`'s message on one line, cut to `limit` characters."""
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def describe_failure(e: BaseException) -> str:
    """One line per failure; DCP's CheckpointException (a BaseException) carries one per rank."""
    if isinstance(e, CheckpointException):
        parts = []
        for rank, wrapped in sorted(e.failures.items()):
            inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
            parts.append(f"rank {rank}: {type(inner).__name__}: {one_line(inner, 200)}")
        return "; ".join(parts) or "CheckpointException"
    return f"{type(e).__name__}: {one_line(e)}"
