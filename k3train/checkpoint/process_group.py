"""Process-group helpers shared by the checkpoint modules (all work without an initialised group)."""

from __future__ import annotations

import torch.distributed as dist


def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def _global_rank() -> int:
    return dist.get_rank() if _dist_on() else 0
