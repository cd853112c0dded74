"""Sharded, atomic, resumable checkpoints (torch.distributed.checkpoint) and Hugging Face name mapping."""

from k3train.checkpoint.checkpointer import Checkpointer
from k3train.checkpoint.errors import CheckpointError
from k3train.checkpoint.manifest import (
    MANIFEST,
    is_complete,
    read_manifest,
    step_dir_name,
    verify_checkpoint,
    write_manifest,
)
from k3train.checkpoint.rng import PerRank, RNGState, capture_rng_state, restore_rng_state
from k3train.checkpoint.signals import GracefulExit

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
