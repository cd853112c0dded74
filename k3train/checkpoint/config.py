"""Checkpoint settings (the `checkpoint:` section of a recipe)."""

from __future__ import annotations

from dataclasses import dataclass

from k3train.config.recipe import check

__all__ = ["CheckpointConfig"]


@dataclass
class CheckpointConfig:
    """Where and when checkpoints are written, and what a run resumes from."""

    dir: str | None = None
    """Checkpoint directory; null means RUN_DIR/checkpoints."""
    interval: int = 0
    """Steps between checkpoints; 0 means only at the end (when save_at_end)."""
    keep_last: int = 3
    """How many of the newest complete checkpoints to keep; 0 keeps all."""
    resume: str = "auto"
    """'auto' resumes from the newest complete checkpoint in dir if there is one; 'none' starts
    fresh; anything else is the path of a checkpoint to resume from."""
    save_at_end: bool = True
    """Write a checkpoint after the last step."""
    async_save: bool = False
    """Write checkpoints in a background thread: a save copies the state (to CPU memory) and
    training continues while it is written; the next save and the end of the run wait for it."""

    def validate(self) -> None:
        """Raise ConfigError naming the first out-of-range field."""
        check(
            [
                (
                    self.interval >= 0,
                    f"checkpoint.interval must be 0 (only at the end) or positive, got {self.interval}",
                ),
                (self.keep_last >= 0, f"checkpoint.keep_last must be 0 (keep all) or positive, got {self.keep_last}"),
                (
                    self.resume != "",
                    "checkpoint.resume must be 'auto', 'none' or a checkpoint path, got an empty string",
                ),
            ]
        )
