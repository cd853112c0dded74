"""Sharded, atomic, resumable checkpoints (torch.distributed.checkpoint) and Hugging Face name mapping."""

from k3train.checkpoint.checkpointer import (
    MANIFEST,
    CheckpointError,
    Checkpointer,
    GracefulExit,
    PerRank,
    RNGState,
    capture_rng_state,
    is_complete,
    read_manifest,
    restore_rng_state,
    step_dir_name,
    verify_checkpoint,
    write_manifest,
)

__all__ = [
    "MANIFEST",
    "CheckpointError",
    "Checkpointer",
    "GracefulExit",
    "PerRank",
    "RNGState",
    "capture_rng_state",
    "is_complete",
    "read_manifest",
    "restore_rng_state",
    "step_dir_name",
    "verify_checkpoint",
    "write_manifest",
]
