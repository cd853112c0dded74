"""Writing one checkpoint: DCP into the `.tmp_` directory, each rank's checksums, then (rank 0) the
manifest and the atomic rename. The same function runs in the caller's thread (synchronous save)
or in the background thread of an asynchronous one, on state that `stage_state` copied."""

from __future__ import annotations

import copy
import logging
import os
import secrets
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import SavePlanner

from k3train.checkpoint.errors import CheckpointError, describe_save_failure
from k3train.checkpoint.integrity import CHECKSUM, ChecksummingWriter, checksum_files, file_checksum
from k3train.checkpoint.manifest import METADATA, OLD_PREFIX, fsync_dir, is_complete, move_aside, write_manifest
from k3train.checkpoint.process_group import (
    broadcast_from_first,
    distributed_active,
    gather_objects,
    group_rank,
    group_size,
)
from k3train.checkpoint.values import JsonSavePlanner

logger = logging.getLogger(__name__)

# DCP warns when it runs without a process group; a single process is a supported use here.
NO_DIST_WARNING = r".*torch\.distributed is disabled.*"


@dataclass
class SaveJob:
    """One checkpoint to write: where, what, and what to say if it fails."""

    step: int
    tmp: Path
    final: Path
    state: dict[str, Any]
    keys: list[str]
    kept: Callable[[], str]
    """Names the checkpoint that stays the newest if this save fails (for the error line)."""
    finished: Callable[[Path], object]
    """Called on rank 0 after the rename (pruning)."""
    planner: SavePlanner | None = None
    """DCP save planner (None: `JsonSavePlanner`); from-hf passes one that reads tensors as DCP writes them."""
    max_file_bytes: int | None = None
    """Files of at most this many tensor bytes (None: one file per rank; `ChecksummingWriter`)."""


def state_bytes(state: Any) -> int:
    """Bytes of the tensors in `state` (this rank's share; DTensors count their local shard)."""
    if isinstance(state, torch.Tensor):
        local = state.to_local() if hasattr(state, "to_local") else state
        return local.numel() * local.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    return 0


def stage_state(state: Any) -> Any:
    """A copy of `state` that training may not change while a background thread writes it: plain
    tensors are copied to CPU memory, DTensors cloned where they are (DCP moves each local shard
    to CPU as it writes it), other values deep-copied."""
    if isinstance(state, torch.Tensor):
        if hasattr(state, "to_local"):
            return state.detach().clone()
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: stage_state(v) for k, v in state.items()}
    if isinstance(state, list):
        return [stage_state(v) for v in state]
    if isinstance(state, tuple):
        return tuple(stage_state(v) for v in state)
    return copy.deepcopy(state)


def write_checkpoint(job: SaveJob, group: Any) -> Path:
    """Write `job` with every rank of `group`; return the final path. Raises `CheckpointError`
    (one line, naming what was kept) on every rank when any rank fails."""
    rank = group_rank(group)
    writer = ChecksummingWriter(job.tmp, sync_files=True, max_file_bytes=job.max_file_bytes)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=NO_DIST_WARNING)
            dcp.save(
                job.state,
                storage_writer=writer,
                planner=job.planner if job.planner is not None else JsonSavePlanner(),
                process_group=group,
                no_dist=not distributed_active(),
            )
        sums = checksum_files(job.tmp, writer.written)
        error = None
    except (Exception, CheckpointException) as e:
        sums = {}
        error = describe_save_failure(e, job.tmp.parent, state_bytes(job.state))
    except BaseException:
        if rank == 0:
            shutil.rmtree(job.tmp, ignore_errors=True)
        raise
    gathered = gather_objects((error, sums), group)  # every rank learns every failure
    errors = [f"rank {r}: {e}" if group_size(group) > 1 else e for r, (e, _) in enumerate(gathered) if e]
    if errors:
        if rank == 0:  # best effort; start-up cleaning removes what a hard crash leaves
            shutil.rmtree(job.tmp, ignore_errors=True)
        raise CheckpointError(f"saving checkpoint {job.final} failed ({'; '.join(errors)}); {job.kept()}")

    failure = None
    if rank == 0:
        try:
            files: dict[str, Any] = {}
            for _, rank_sums in gathered:
                files.update(rank_sums)
            files[METADATA] = file_checksum(job.tmp / METADATA)
            finish_checkpoint(job, files, group_size(group))
        except Exception as e:  # report on every rank, not only here
            failure = describe_save_failure(e, job.tmp.parent, 0)
            shutil.rmtree(job.tmp, ignore_errors=True)
    failure = broadcast_from_first(failure, group)
    if failure is not None:
        raise CheckpointError(f"saving checkpoint {job.final} failed on rank 0 ({failure}); {job.kept()}")
    return job.final


def finish_checkpoint(job: SaveJob, files: dict[str, Any], world_size: int) -> None:
    """Rank 0: the manifest with every file's checksum, then the rename into place (atomic)."""
    write_manifest(job.tmp, job.step, world_size=world_size, keys=job.keys, checksum=CHECKSUM, files=files)
    final = job.final
    old: Path | None = None
    if final.exists():
        if is_complete(final):  # the same step saved again (after a resume): replace it
            old = final.parent / f"{OLD_PREFIX}{final.name}_{secrets.token_hex(4)}"
            logger.warning("replacing existing %s", final)
            os.replace(final, old)
        else:
            moved = move_aside(final, "incomplete")
            logger.warning("%s is an incomplete checkpoint: moved aside to %s, not overwritten", final, moved.name)
    os.replace(job.tmp, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    job.finished(final)
