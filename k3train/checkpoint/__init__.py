"""Sharded, atomic, resumable checkpoints (torch.distributed.checkpoint) and Hugging Face name mapping."""

from __future__ import annotations

from typing import TYPE_CHECKING

from k3train.lazy_exports import lazy_exports

if TYPE_CHECKING:  # static tools and IDEs see the real imports
    from k3train.checkpoint.checkpointer import Checkpointer
    from k3train.checkpoint.errors import CheckpointError
    from k3train.checkpoint.manifest import (
        MANIFEST,
        is_complete,
        read_manifest,
        step_dir_name,
        write_manifest,
    )
    from k3train.checkpoint.rng import PerRank, RNGState, capture_rng_state, restore_rng_state
    from k3train.checkpoint.verify import checkpoint_problems, verify_checkpoint

# Each name loads its submodule on first use, so that importing `k3train.checkpoint.config` (as the
# torch-free config loader does) does not import torch through this package.
_SUBMODULE_OF = {
    "MANIFEST": "k3train.checkpoint.manifest",
    "CheckpointError": "k3train.checkpoint.errors",
    "Checkpointer": "k3train.checkpoint.checkpointer",
    "PerRank": "k3train.checkpoint.rng",
    "RNGState": "k3train.checkpoint.rng",
    "capture_rng_state": "k3train.checkpoint.rng",
    "is_complete": "k3train.checkpoint.manifest",
    "read_manifest": "k3train.checkpoint.manifest",
    "restore_rng_state": "k3train.checkpoint.rng",
    "step_dir_name": "k3train.checkpoint.manifest",
    "verify_checkpoint": "k3train.checkpoint.verify",
    "checkpoint_problems": "k3train.checkpoint.verify",
    "write_manifest": "k3train.checkpoint.manifest",
}

__all__ = [
    "MANIFEST",
    "CheckpointError",
    "Checkpointer",
    "PerRank",
    "RNGState",
    "capture_rng_state",
    "checkpoint_problems",
    "is_complete",
    "read_manifest",
    "restore_rng_state",
    "step_dir_name",
    "verify_checkpoint",
    "write_manifest",
]


__getattr__, __dir__ = lazy_exports(__name__, _SUBMODULE_OF)
