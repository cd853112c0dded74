"""`Checkpointer`: sharded, atomic, verified, resumable checkpoints on `torch.distributed.checkpoint` (DCP).

The layout, the atomic save/rename protocol, checksums, what is saved for each kind of
`app_state` value and the DCP behaviour this relies on are described in docs/checkpoints.md. The
pieces: `manifest.py` (layout, manifest), `verify.py` (is a directory usable?), `writing.py` (one
save), `integrity.py` (checksums), `safe_metadata.py` and `values.py` (reading without running
code), `state.py` (what is saved), `load_plan.py` (what a load reads and how it is put back),
`rng.py` (`RNGState`, `PerRank`), `process_group.py`.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from k3train.checkpoint.errors import CheckpointError, describe_failure
from k3train.checkpoint.load_plan import plan_load
from k3train.checkpoint.manifest import (
    DAMAGED_INFIX,
    METADATA,
    OLD_PREFIX,
    TMP_PREFIX,
    complete_checkpoints,
    fsync_dir,
    is_complete,
    move_aside,
    replaced_step_name,
    resume_hint,
    step_dir_name,
    step_of,
)
from k3train.checkpoint.process_group import (
    barrier,
    broadcast_from_first,
    distributed_active,
    first_error,
    gather_objects,
    group_rank,
    group_size,
    new_group_like,
)
from k3train.checkpoint.safe_metadata import SafeFileSystemReader
from k3train.checkpoint.state import FlatLoadPlanner, parameter_names, saveable_state
from k3train.checkpoint.verify import checkpoint_problems, verify_checkpoint
from k3train.checkpoint.writing import NO_DIST_WARNING, SaveJob, stage_state, write_checkpoint

logger = logging.getLogger(__name__)


class Checkpointer:
    """Save and load `app_state` (modules, optimizers, stateful objects, plain values) as DCP
    checkpoints under `directory`, keeping the newest `keep_last` (0: all).

    Works in a single process without a process group and with an initialised one (every rank
    calls `save`/`load`/`resolve_resume`; rank 0 of `process_group`, or of the default group,
    renames, prunes and writes the manifest). With `async_save` a save copies the state and
    returns; a background thread writes it (on a gloo group of its own, so it never interleaves
    with training's collectives) and the next save, `load` and `wait()` wait for it. Call `wait()`
    before the process exits. docs/checkpoints.md describes the layout and what is saved.
    """

    def __init__(
        self, directory: str | Path, keep_last: int = 3, process_group: Any = None, async_save: bool = False
    ) -> None:
        if keep_last < 0:
            raise ValueError(f"keep_last must be >= 0 (0 keeps all), got {keep_last}")
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.process_group = process_group
        self.async_save = async_save
        self._verified: dict[Path, Metadata] = {}  # checked by resolve_resume, not read twice by load
        self._pending: Future | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._write_group = process_group
        if async_save:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="k3train-checkpoint")
            self._write_group = new_group_like(process_group)
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

    def latest(self) -> Path | None:
        """The complete checkpoint with the highest step, or None (temp and incomplete dirs are ignored)."""
        found = self.checkpoints()
        return found[-1][1] if found else None

    def _kept(self) -> str:
        latest = self.latest()
        if latest is None:
            return f"no earlier checkpoint in {self.directory} was touched (there is none)"
        return f"the newest complete checkpoint {latest} is kept"

    def resolve_resume(self, resume: str | Path | None) -> Path | None:
        """`"auto"`: the newest checkpoint that passes verification (checksums included); a damaged
        or incomplete newer one is moved aside (`step_X.damaged-<reason>`) with a warning naming it
        and why; None when there is no checkpoint. `"none"`/`""`/None: None; otherwise a
        checkpoint path (relative paths are also tried below `directory`), which must be usable."""
        if resume is None:
            return None
        text = str(resume).strip()
        if text.lower() in ("", "none"):
            return None
        if text.lower() == "auto":
            return self._newest_usable()
        path = Path(text).expanduser()
        if not path.exists() and not path.is_absolute() and (self.directory / path).exists():
            path = self.directory / path
        if not path.exists():
            aside = sorted(path.parent.glob(f"{path.name}{DAMAGED_INFIX}*")) if path.parent.is_dir() else []
            if aside:  # start-up moved it aside (incomplete or damaged): say so, not "does not exist"
                raise CheckpointError(
                    f"checkpoint.resume={text}: that checkpoint was unusable and is kept as {aside[-1]} "
                    f"(its reason is in the name); pass checkpoint.resume=auto or another checkpoint"
                )
        try:
            verify_checkpoint(path, checksums=False)
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

    def _newest_usable(self) -> Path | None:
        """Every rank checks its share of the newest checkpoint's files; one that any rank finds
        damaged is moved aside by rank 0 and the next older one is tried."""
        rank, size = self._rank(), group_size(self.process_group)
        moved: list[str] = []
        candidates = [path for _, path in self.checkpoints()]
        candidates = broadcast_from_first(candidates, self.process_group)  # the same list everywhere
        for path in reversed(candidates):
            verdict = checkpoint_problems(path, checksums=True, share=(rank, size))
            problem = verdict.problems[0] if verdict.problems else None
            found = [p for p in gather_objects(problem, self.process_group) if p is not None]
            if not found:
                if verdict.metadata is not None:
                    self._verified[path.resolve()] = verdict.metadata
                return path
            if rank == 0:
                aside = move_aside(path, found[0].reason)
                logger.warning(
                    "checkpoint %s is unusable (%s): moved aside to %s; trying the previous one",
                    path.name,
                    found[0].message,
                    aside.name,
                )
            moved.append(f"{path.name} ({found[0].reason})")
            barrier(self.process_group)
        if moved:
            raise CheckpointError(
                f"no usable checkpoint in {self.directory}: {', '.join(moved)} moved aside as damaged; pass "
                "checkpoint.resume=none to start fresh or checkpoint.resume=<a checkpoint> to choose one"
            )
        return None

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
            elif step_of(entry.name) is not None and not is_complete(entry):
                # Only a complete save is ever renamed to a step name: this one was damaged (or
                # copied in part). Keep it for inspection, out of the way of resume and pruning.
                aside = move_aside(entry, "incomplete")
                logger.warning(
                    "checkpoint %s is incomplete (no .metadata or no complete manifest): moved aside to %s",
                    entry.name,
                    aside.name,
                )
        fsync_dir(self.directory)

    def _prune(self, keep: Path) -> list[Path]:
        """Remove the oldest complete checkpoints beyond `keep_last` (damaged ones moved aside are
        neither counted nor removed)."""
        newer = [p.name for s, p in self.checkpoints() if s > (step_of(keep.name) or 0)]
        if newer:
            logger.warning(
                "saved %s while newer checkpoints exist (%s); resume=auto picks the highest step",
                keep.name,
                ", ".join(newer),
            )
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
        complete (manifest with checksums written, then renamed); an existing complete directory
        of the same step is replaced, an incomplete one moved aside. With `async_save` the path
        appears when the background write finishes (`wait()`); an earlier asynchronous save is
        waited for first, and its failure is raised here.
        """
        self.wait()
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
            if self.async_save:
                state = stage_state(state)  # training may change the live tensors from now on
        except Exception as e:
            error = describe_failure(e)
        error = first_error(error, self.process_group)  # no rank enters DCP's collectives when another has failed
        if error is not None:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"saving checkpoint {final} failed ({error}); {self._kept()}")

        job = SaveJob(
            step=step,
            tmp=tmp,
            final=final,
            state=state,
            keys=sorted(app_state),
            kept=self._kept,
            finished=lambda path: self._prune(keep=path),
        )
        if self._executor is None:
            return write_checkpoint(job, self.process_group)
        self._pending = self._executor.submit(self._write_in_background, job)
        return final

    def _write_in_background(self, job: SaveJob) -> Path:
        try:
            path = write_checkpoint(job, self._write_group)
        except CheckpointError as e:
            logger.error("%s", e)
            raise
        logger.info("checkpoint written: %s", path)
        return path

    def wait(self) -> Path | None:
        """Wait for an asynchronous save still being written; return its path (None when there
        was none). Raises its `CheckpointError` if it failed. Every rank calls this before exit."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        return pending.result()

    # -- load ---------------------------------------------------------------------------------

    def load(self, path: str | Path, app_state: dict[str, Any]) -> None:
        """Load checkpoint `path` into `app_state` in place; every rank of the group calls this.

        Raises `CheckpointError` for a missing, incomplete, truncated or damaged (checksum)
        checkpoint, and for keys or shapes that do not match the modules and optimizers in `app_state`.
        """
        self.wait()
        path = Path(path)
        failure: CheckpointError | None = None
        metadata = None
        try:
            metadata = self._verified.pop(path.resolve(), None)
            if metadata is None:  # the ranks share the reading of the files for their checksums
                metadata = verify_checkpoint(path, share=(self._rank(), group_size(self.process_group)))
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
                warnings.filterwarnings("ignore", message=NO_DIST_WARNING)
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
