"""Process-group helpers shared by the checkpoint modules. Each works without an initialised
process group too: one process is rank 0 of 1 and the collectives are identities."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def distributed_active() -> bool:
    """Whether torch.distributed is initialised in this process."""
    return dist.is_available() and dist.is_initialized()


def global_rank() -> int:
    return dist.get_rank() if distributed_active() else 0


def group_rank(group: Any = None) -> int:
    """This process's rank in `group` (the default group when None)."""
    return dist.get_rank(group) if distributed_active() else 0


def group_size(group: Any = None) -> int:
    return dist.get_world_size(group) if distributed_active() else 1


def barrier(group: Any = None) -> None:
    if distributed_active():
        dist.barrier(group=group)


def broadcast_from_first(obj: Any, group: Any = None) -> Any:
    """Rank 0's `obj` on every rank of `group`."""
    if not distributed_active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, group=group, group_src=0)
    return box[0]


def first_error(error: str | None, group: Any = None) -> str | None:
    """The lowest rank's error (`"rank r: …"`) on every rank of `group`, None when no rank has one.

    Every rank calls this before a collective that a failed rank would not enter, so no rank
    waits forever on another that already gave up."""
    if not distributed_active():
        return error
    errors: list[str | None] = [None] * group_size(group)
    dist.all_gather_object(errors, error, group=group)
    for rank, e in enumerate(errors):
        if e is not None:
            return f"rank {rank}: {e}"
    return None


def gather_objects(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's `obj`, by rank in `group`, on every rank (`[obj]` in one process)."""
    if not distributed_active():
        return [obj]
    out: list[Any] = [None] * group_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def new_group_like(group: Any = None) -> Any:
    """A new gloo group over the ranks of `group` (None when not distributed). Every rank of the
    default group must call this (torch's rule for `new_group`)."""
    if not distributed_active():
        return None
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    return dist.new_group(ranks=ranks, backend="gloo")
