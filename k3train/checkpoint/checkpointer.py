"""`Checkpointer`: sharded, atomic, resumable checkpoints on `torch.distributed.checkpoint` (DCP).

The layout, the atomic save/rename protocol, what is saved for each kind of `app_state` value
and the DCP behaviour this relies on are described in docs/checkpoints.md. The pieces:
`manifest.py` (layout, manifest, verification), `state.py` (what is saved), `load_plan.py` (what
a load reads and how it is put back), `rng.py` (`RNGState`, `PerRank`), `signals.py`
(`GracefulExit`), `process_group.py` (collectives that also work in one process).
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import warnings
from pathlib import Path
from typing import Any, Optional

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from k3train.checkpoint.errors import CheckpointError, describe_failure
from k3train.checkpoint.load_plan import plan_load
from k3train.checkpoint.manifest import (
    METADATA,
    OLD_PREFIX,
    TMP_PREFIX,
    complete_checkpoints,
    fsync_dir,
    is_complete,
    replaced_step_name,
    resume_hint,
    step_dir_name,
    verify_checkpoint,
    write_manifest,
)
from k3train.checkpoint.process_group import (
    barrier,
    broadcast_from_first,
    distributed_active,
    first_error,
    group_rank,
    group_size,
)
from k3train.checkpoint.safe_metadata import SafeFileSystemReader
from k3train.checkpoint.state import FlatLoadPlanner, parameter_names, saveable_state
from k3train.checkpoint.values import JsonSavePlanner

logger = logging.getLogger(__name__)

# DCP warns when it runs without a process group; a single process is a supported use here.
_NO_DIST_WARNING = r".*torch\.distributed is disabled.*"


class Checkpointer:
    """Save and load `app_state` (modules, optimizers, stateful objects, plain values) as DCP
    checkpoints under `directory`, keeping the newest `keep_last` (0: all).

    Works in a single process without a process group and with an initialised one (every rank
    calls `save`/`load`; rank 0 of `process_group`, or of the default group, renames, prunes and
    writes the manifest). docs/checkpoints.md describes the layout and what is saved.
    """

    def __init__(self, directory: str | Path, keep_last: int = 3, process_group: Any = None) -> None:
        if keep_last < 0:
            raise ValueError(f"keep_last must be >= 0 (0 keeps all), got {keep_last}")
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.process_group = process_group
        if self._rank() == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._clean_stale()
        barrier(self.process_group)

    def _rank(self) -> int:
        return group_rank(self.process_group)

    # -- listing ----------------------------------------------------------------------------

    def checkpoints(self) -> list[tuple[int, Path]]:
        """Complete checkpoints as (step, path), oldest step first."""
        return complete_checkpoints(self.directory)

    def latest(self) -> Optional[Path]:
        """The complete checkpoint with the highest step, or None (temp and incomplete dirs are ignored)."""
        found = self.checkpoints()
        return found[-1][1] if found else None

    def resolve_resume(self, resume: Optional[str | Path]) -> Optional[Path]:
        """`"auto"`: `latest()` (None when there is none); `"none"`/`""`/None: None; otherwise a
        checkpoint path (relative paths are also tried below `directory`), which must be complete."""
        if resume is None:
            return None
        text = str(resume).strip()
        if text.lower() in ("", "none"):
            return None
        if text.lower() == "auto":
            return self.latest()
        path = Path(text).expanduser()
        if not path.exists() and not path.is_absolute() and (self.directory / path).exists():
            path = self.directory / path
        try:
            verify_checkpoint(path)
        except CheckpointError as e:
            if path.is_dir() and not (path / METADATA).exists():
                below = complete_checkpoints(path)
                if below:
                    inner = below[-1][1]
                    raise CheckpointError(
                        f"{e}; {path} looks like a checkpoint root: pass checkpoint.resume={inner} "
                        "or checkpoint.resume=auto with checkpoint.dir pointing there"
                    ) from None
            raise
        return path

    # -- start-up cleaning, pruning ----------------------------------------------------------

    def _clean_stale(self) -> None:
        for entry in sorted(self.directory.iterdir()):
            if not entry.is_dir():
                continue
            if entry.name.startswith(TMP_PREFIX):
                logger.warning("removing the remains of an unfinished checkpoint save: %s", entry)
                shutil.rmtree(entry, ignore_errors=True)
            elif entry.name.startswith(OLD_PREFIX):
                final_name = replaced_step_name(entry.name)
                final = self.directory / final_name if final_name else None
                if final is not None and not final.exists() and is_complete(entry):
                    logger.warning("restoring %s (its replacement was never renamed into place)", final)
                    os.replace(entry, final)
                else:
                    shutil.rmtree(entry, ignore_errors=True)
        fsync_dir(self.directory)

    def _prune(self, keep: Path) -> list[Path]:
        if self.keep_last == 0:
            return []
        found = [path for _, path in self.checkpoints() if path != keep]
        excess = len(found) + 1 - self.keep_last
        removed = []
        for path in found[: max(excess, 0)]:
            # Rename first: a crash halfway through rmtree must not leave a dir that still looks
            # complete (manifest and .metadata present, data files gone); start-up removes .tmp_*.
            doomed = self.directory / f"{TMP_PREFIX}prune_{path.name}_{secrets.token_hex(4)}"
            os.replace(path, doomed)
            shutil.rmtree(doomed, ignore_errors=True)
            removed.append(path)
        if removed:
            fsync_dir(self.directory)
            logger.info("pruned checkpoints: %s", ", ".join(p.name for p in removed))
        return removed

    # -- save ---------------------------------------------------------------------------------

    def save(self, step: int, app_state: dict[str, Any]) -> Path:
        """Save `app_state` as `directory/step_<step>`; every rank of the group calls this.

        Returns the final path. Atomic: the directory appears under its final name only when
        complete; an existing directory of the same step is replaced.
        """
        final = self.directory / step_dir_name(step)
        rank = self._rank()
        tmp_name = None
        if rank == 0:
            tmp_name = f"{TMP_PREFIX}{final.name}_{secrets.token_hex(4)}"
            (self.directory / tmp_name).mkdir(parents=True)
        tmp = self.directory / broadcast_from_first(tmp_name, self.process_group)

        error = None
        try:
            by_id = parameter_names(app_state)
            state = {key: saveable_state(obj, by_id) for key, obj in app_state.items()}
        except Exception as e:
            error = describe_failure(e)
        error = first_error(error, self.process_group)  # no rank enters DCP's collectives when another has failed
        if error is not None:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"saving checkpoint {final} failed ({error})")

        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=_NO_DIST_WARNING)
                dcp.save(
                    state,
                    storage_writer=FileSystemWriter(str(tmp), sync_files=True),
                    planner=JsonSavePlanner(),
                    process_group=self.process_group,
                    no_dist=not distributed_active(),
                )
        except (Exception, CheckpointException) as e:
            if rank == 0:  # best effort; start-up cleaning removes what a hard crash leaves
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"saving checkpoint {final} failed ({describe_failure(e)})") from e
        except BaseException:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise

        error = None
        if rank == 0:
            try:
                self._finish(step, tmp, final, sorted(app_state))
            except Exception as e:  # report on every rank, not only here
                error = f"{type(e).__name__}: {e}"
        error = broadcast_from_first(error, self.process_group)
        if error is not None:
            raise CheckpointError(f"saving checkpoint {final} failed on rank 0: {error}")
        return final

    def _finish(self, step: int, tmp: Path, final: Path, keys: list[str]) -> None:
        write_manifest(tmp, step, world_size=group_size(self.process_group), keys=keys)
        old = None
        if final.exists():
            old = self.directory / f"{OLD_PREFIX}{final.name}_{secrets.token_hex(4)}"
            logger.warning("replacing existing %s", final)
            os.replace(final, old)
        os.replace(tmp, final)
        fsync_dir(self.directory)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        newer = [p.name for s, p in self.checkpoints() if s > step]
        if newer:
            logger.warning(
                "saved step %d while newer checkpoints exist (%s); resume=auto picks the highest step",
                step, ", ".join(newer),
            )
        self._prune(keep=final)

    # -- load ---------------------------------------------------------------------------------

    def load(self, path: str | Path, app_state: dict[str, Any]) -> None:
        """Load checkpoint `path` into `app_state` in place; every rank of the group calls this.

        Raises `CheckpointError` for a missing, incomplete or truncated checkpoint, and for keys or
        shapes that do not match the modules and optimizers in `app_state`.
        """
        path = Path(path)
        failure: Optional[CheckpointError] = None
        try:
            metadata = verify_checkpoint(path)
            target = plan_load(path, metadata, app_state, group_size(self.process_group))
        except CheckpointError as e:
            failure = e
        agreed = first_error(None if failure is None else str(failure), self.process_group)
        if failure is not None:
            raise failure
        if agreed is not None:  # another rank cannot load: do not enter DCP's collectives
            raise CheckpointError(agreed)

        loaded_values: dict[str, Any] = {}
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=_NO_DIST_WARNING)
                dcp.load(
                    target.flat,
                    storage_reader=SafeFileSystemReader(path, metadata),
                    planner=FlatLoadPlanner(loaded_values),
                    process_group=self.process_group,
                    no_dist=not distributed_active(),
                )
        except (Exception, CheckpointException) as e:
            raise CheckpointError(
                f"reading checkpoint {path} failed ({describe_failure(e)}); the files may "
                f"be damaged: {resume_hint(path)}"
            ) from e
        target.finish(loaded_values)
