"""`UserError`: the base of every failure the person running a job or a tool can fix.

Its message is one line (or a few short ones) naming the field, file or flag and the fix; the
job (`pretrain_k3.py`) and the tools catch `UserError` once, print `error: <message>` and exit
with status 2. Anything else is a bug or a lost peer and keeps its own handling. Each room keeps
its own subclass (`ConfigError`, `LayoutError`, `DataError`, `CheckpointError`, `TrainingError`,
...), so a caller can still tell them apart. Nothing here imports torch.
"""

from __future__ import annotations

__all__ = ["RunDirectoryError", "UserError"]


class UserError(Exception):
    """A failure the user can fix; `str(error)` is the whole message."""


class RunDirectoryError(UserError, OSError):
    """A run, checkpoint or metrics location that cannot be created, read or written."""
