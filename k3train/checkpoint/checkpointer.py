"""Sharded, atomic, resumable checkpoints on `torch.distributed.checkpoint` (DCP).

Layout (SPEC §2, checkpoints row)::

    DIR/step_00000010/          one complete checkpoint
        .metadata               DCP's global metadata (written last by DCP, by the coordinator)
        __<rank>_<n>.distcp     DCP data files, one or more per rank
        k3train.json            manifest: step, time, torch version, world size, "complete": true
    DIR/.tmp_step_00000010_<random>/   a save in progress (or the remains of a crashed one)
    DIR/.old_step_00000010_<random>/   an older checkpoint of the same step, moved aside while
                                       the new one is renamed into place

A save writes into the `.tmp_` directory, lets DCP finish (every rank's data, then `.metadata`),
writes the manifest, fsyncs and renames the directory to its final name (`os.replace`). Only a
directory with both `.metadata` and a complete manifest counts as a checkpoint, so a crash at any
point leaves the newest complete checkpoint untouched. Start-up removes `.tmp_` remains and puts
back an `.old_` directory whose replacement never arrived.

What is saved for each `app_state` value:

* `nn.Module`: `module.state_dict()` (parameters, persistent buffers such as the QB biases), keys
  without `torch.compile`/activation-checkpoint wrapper prefixes; loaded in place into the
  module's own tensors (DTensor parameters are resharded by DCP), then `load_state_dict`.
* `torch.optim.Optimizer`: the optimizer's own `state_dict()`, re-keyed by parameter name instead
  of position: `state.<param>.<key>` and `param_groups.<param>` (every parameter carries its
  group's options as one pickled tuple of (option, value) pairs). The name is the module's
  checkpoint key (`model.layers.0.w`) when a module in `app_state` holds the parameter, else the
  group's `param_names`, else `group<i>.param<j>`.
  Loading builds the target from the checkpoint's metadata (a fresh optimizer has no state to
  load into; no dummy optimizer step is taken, so any `Optimizer` subclass round-trips), keeps
  only the parameters this optimizer holds (a pipeline stage reads its own layers) and calls
  `load_state_dict`. Why not positions: they differ between pipeline stages and layouts.
* anything else with `state_dict()`/`load_state_dict()`: that state dict; loading merges the
  checkpoint into the object's current `state_dict()` and calls `load_state_dict`.
* plain values (ints, floats, strings, nested dicts/lists, tensors): saved as they are; loading
  updates a dict (or list) in place and copies into existing tensors of the same shape; other
  values are replaced in `app_state`. Every key the checkpoint holds under the value's name is
  read, so a dict whose keys differ per rank comes back with all ranks' keys: use `PerRank`.

DCP facts this relies on (checked with torch 2.13):

* `dcp.save`/`dcp.load` run in one process without `init_process_group`: with `no_dist=True`
  (or automatically, with a UserWarning, when torch.distributed is not initialised). We pass
  `no_dist` explicitly and silence that warning.
* Nested dicts are flattened to dotted keys; non-integer dict keys become strings (`{0: t}` comes
  back as `{"0": t}`), empty dicts vanish, a list is split per index only if it holds tensors or
  dicts, and tuples are always one value. Every non-tensor leaf is saved as pickled bytes and read
  back with `torch.load(weights_only=False)`: load only checkpoints you trust.
* A value that several ranks save under the same key is written once (DCP deduplicates by key),
  so state that differs between ranks must have rank-specific keys. `PerRank` does that
  (`<key>.rank_<r>.*`, global rank); `RNGState` is `PerRank` around the process's RNG streams.
  When a checkpoint is loaded by more ranks than saved it, a rank without its own entry keeps its
  current state and warns.
* The default load planner matches keys exactly and reshards tensors (including DTensors) to the
  target's layout; a read of a missing or short `.distcp` file fails deep inside DCP, so
  `verify_checkpoint` checks the files and sizes listed in `.metadata` first.

Where the pieces live: `manifest.py` (layout, manifest, `verify_checkpoint`), `state.py`
(state-dict conversion, the load planner), `rng.py` (`RNGState`, `PerRank`), `signals.py`
(`GracefulExit`), `errors.py` (`CheckpointError`); this module holds the `Checkpointer`.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import warnings
from pathlib import Path
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from k3train.checkpoint.errors import CheckpointError, _describe, _short
from k3train.checkpoint.manifest import (
    METADATA,
    OLD_PREFIX,
    TMP_PREFIX,
    _OLD_RE,
    _STEP_RE,
    _fix_hint,
    _fsync_dir,
    is_complete,
    step_dir_name,
    verify_checkpoint,
    write_manifest,
)
from k3train.checkpoint.process_group import _dist_on
from k3train.checkpoint.rng import PerRank
from k3train.checkpoint.state import (
    _alloc,
    _clean_name,
    _FlatLoadPlanner,
    _is_stateful,
    _merge,
    _module_state,
    _optimizer_names,
    _param_names,
    _saveable,
    _unflatten,
)

logger = logging.getLogger(__name__)

_MAX_LISTED = 5


def _listing(keys: Iterable[str], total: Optional[int] = None) -> str:
    keys = list(keys)
    total = len(keys) if total is None else total
    shown = ", ".join(keys[:_MAX_LISTED])
    return f"{shown}{', ...' if total > _MAX_LISTED else ''} ({total} in all)"


class Checkpointer:
    """Save and load `app_state` (modules, optimizers, stateful objects, plain values) as DCP
    checkpoints under `directory`, keeping the newest `keep_last` (0: all).

    Works in a single process without a process group and with an initialised one (every rank
    calls `save`/`load`; rank 0 of `process_group`, or of the default group, renames, prunes and
    writes the manifest). See the module docstring for the layout and what is saved.
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
        self._barrier()

    # -- process group ----------------------------------------------------------------------

    def _rank(self) -> int:
        return dist.get_rank(self.process_group) if _dist_on() else 0

    def _world_size(self) -> int:
        return dist.get_world_size(self.process_group) if _dist_on() else 1

    def _barrier(self) -> None:
        if _dist_on():
            dist.barrier(group=self.process_group)

    def _broadcast(self, obj: Any) -> Any:
        """rank 0's `obj` on every rank (identity without a process group)."""
        if not _dist_on():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, group=self.process_group, group_src=0)
        return box[0]

    def _agree(self, error: Optional[str]) -> Optional[str]:
        """The first rank's error, on every rank (this rank's error without a process group)."""
        if not _dist_on():
            return error
        errors: list[Optional[str]] = [None] * self._world_size()
        dist.all_gather_object(errors, error, group=self.process_group)
        for r, e in enumerate(errors):
            if e is not None:
                return f"rank {r}: {e}"
        return None

    # -- listing ----------------------------------------------------------------------------

    def checkpoints(self) -> list[tuple[int, Path]]:
        """Complete checkpoints as (step, path), oldest step first."""
        found = []
        if not self.directory.is_dir():
            return found
        for entry in self.directory.iterdir():
            m = _STEP_RE.match(entry.name)
            if m and entry.is_dir() and is_complete(entry):
                found.append((int(m.group(1)), entry))
        return sorted(found)

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
                inner = Checkpointer._complete_below(path)
                if inner is not None:
                    raise CheckpointError(
                        f"{e}; {path} looks like a checkpoint root: pass checkpoint.resume={inner} "
                        "or checkpoint.resume=auto with checkpoint.dir pointing there"
                    ) from None
            raise
        return path

    @staticmethod
    def _complete_below(root: Path) -> Optional[Path]:
        steps = [
            (int(m.group(1)), e)
            for e in root.iterdir()
            if (m := _STEP_RE.match(e.name)) and e.is_dir() and is_complete(e)
        ]
        return max(steps)[1] if steps else None

    # -- start-up cleaning, pruning ----------------------------------------------------------

    def _clean_stale(self) -> None:
        for entry in sorted(self.directory.iterdir()):
            if not entry.is_dir():
                continue
            if entry.name.startswith(TMP_PREFIX):
                logger.warning("removing the remains of an unfinished checkpoint save: %s", entry)
                shutil.rmtree(entry, ignore_errors=True)
            elif entry.name.startswith(OLD_PREFIX):
                m = _OLD_RE.match(entry.name)
                final = self.directory / m.group(1) if m else None
                if final is not None and not final.exists() and is_complete(entry):
                    logger.warning("restoring %s (its replacement was never renamed into place)", final)
                    os.replace(entry, final)
                else:
                    shutil.rmtree(entry, ignore_errors=True)
        _fsync_dir(self.directory)

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
            _fsync_dir(self.directory)
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
        tmp = self.directory / self._broadcast(tmp_name)

        error = None
        try:
            by_id = _param_names(app_state)
            state = {key: _saveable(key, obj, by_id) for key, obj in app_state.items()}
        except Exception as e:
            error = _describe(e)
        error = self._agree(error)  # no rank enters DCP's collectives when another has failed
        if error is not None:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"saving checkpoint {final} failed ({error})")

        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=r".*torch\.distributed is disabled.*")
                dcp.save(
                    state,
                    storage_writer=FileSystemWriter(str(tmp), sync_files=True),
                    planner=DefaultSavePlanner(),
                    process_group=self.process_group,
                    no_dist=not _dist_on(),
                )
        except (Exception, CheckpointException) as e:
            if rank == 0:  # best effort; start-up cleaning removes what a hard crash leaves
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"saving checkpoint {final} failed ({_describe(e)})") from e
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
        error = self._broadcast(error)
        if error is not None:
            raise CheckpointError(f"saving checkpoint {final} failed on rank 0: {error}")
        return final

    def _finish(self, step: int, tmp: Path, final: Path, keys: list[str]) -> None:
        write_manifest(tmp, step, world_size=self._world_size(), keys=keys)
        old = None
        if final.exists():
            old = self.directory / f"{OLD_PREFIX}{final.name}_{secrets.token_hex(4)}"
            logger.warning("replacing existing %s", final)
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(self.directory)
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
            flat, finishers = self._plan_load(path, app_state)
        except CheckpointError as e:
            failure = e
        agreed = self._agree(None if failure is None else str(failure))
        if failure is not None:
            raise failure
        if agreed is not None:  # another rank cannot load: do not enter DCP's collectives
            raise CheckpointError(agreed)

        loaded_bytes: dict[str, Any] = {}
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=r".*torch\.distributed is disabled.*")
                dcp.load(
                    flat,
                    storage_reader=FileSystemReader(str(path)),
                    planner=_FlatLoadPlanner(loaded_bytes),
                    process_group=self.process_group,
                    no_dist=not _dist_on(),
                )
        except (Exception, CheckpointException) as e:
            raise CheckpointError(
                f"reading checkpoint {path} failed ({_describe(e)}); the files may "
                f"be damaged: {_fix_hint(path)}"
            ) from e
        flat.update(loaded_bytes)
        for finish in finishers:
            finish(flat)

    def _plan_load(self, path: Path, app_state: dict[str, Any]) -> tuple[dict[str, Any], list]:
        """Verify `path`; return DCP's flat load target and one finishing step per app_state key."""
        metadata = verify_checkpoint(path)
        mapping: dict[str, tuple] = dict(metadata.planner_data or {})
        for fqn in metadata.state_dict_metadata:
            if fqn not in mapping:  # a checkpoint written without DCP's flattening planner
                head, _, tail = fqn.partition(".")
                mapping[fqn] = (head, tail) if tail else (head,)
        entries: dict[str, list[tuple[str, tuple]]] = {}
        for fqn, p in mapping.items():
            if fqn in metadata.state_dict_metadata:
                entries.setdefault(str(p[0]), []).append((fqn, tuple(p[1:])))

        by_id = _param_names(app_state)
        flat: dict[str, Any] = {}
        finishers = []
        for key, obj in app_state.items():
            ckpt = entries.get(key, [])
            if isinstance(obj, nn.Module):
                finishers.append(self._plan_module(path, key, obj, ckpt, metadata, flat))
            elif isinstance(obj, torch.optim.Optimizer):
                finishers.append(self._plan_optimizer(path, key, obj, ckpt, metadata, flat, by_id))
            else:
                finishers.append(self._plan_other(path, key, obj, ckpt, metadata, flat, app_state))
        return flat, finishers

    @staticmethod
    def _mismatch(path: Path, key: str, what: str, missing: list[str], unexpected: list[str],
                  shapes: list[str]) -> CheckpointError:
        parts = []
        if missing:
            parts.append(f"missing in the checkpoint: {_listing(missing)}")
        if unexpected:
            parts.append(f"in the checkpoint but not in the {what}: {_listing(unexpected)}")
        if shapes:
            parts.append(f"shape mismatch (checkpoint vs {what}): {_listing(shapes)}")
        return CheckpointError(
            f"checkpoint {path} does not match {what} '{key}': " + "; ".join(parts)
            + ". Was it written for another model configuration?"
        )

    def _plan_module(self, path, key, module, ckpt, metadata, flat):
        raw, clean = _module_state(module)
        sdm = metadata.state_dict_metadata
        by_name: dict[str, list[tuple[str, tuple]]] = {}
        for fqn, sub in ckpt:
            by_name.setdefault(str(sub[0]) if sub else "", []).append((fqn, sub))
        missing, shapes = [], []
        for name, value in clean.items():
            found = by_name.get(name)
            if not found:
                missing.append(name)
                continue
            if isinstance(value, torch.Tensor):
                fqn, sub = found[0]
                md = sdm[fqn]
                if len(found) != 1 or len(sub) != 1 or not isinstance(md, TensorStorageMetadata):
                    shapes.append(f"{name} (not one tensor) vs {tuple(value.shape)}")
                elif tuple(md.size) != tuple(value.shape):
                    shapes.append(f"{name} {tuple(md.size)} vs {tuple(value.shape)}")
                else:
                    flat[fqn] = value
            else:  # extra state (get_extra_state): whatever was saved, read back as saved
                for fqn, _ in found:
                    md = sdm[fqn]
                    flat[fqn] = _alloc(md) if isinstance(md, TensorStorageMetadata) else None
        # Under pipeline/expert parallelism a rank holds part of the model, so keys only other
        # ranks load are expected; a single process must account for every key.
        unexpected = []
        if self._world_size() == 1:
            unexpected = sorted(name for name in by_name if name not in clean)
        if missing or unexpected or shapes:
            raise self._mismatch(path, key, "module", missing, unexpected, shapes)

        def finish(loaded: dict[str, Any]) -> None:
            for raw_key, value in raw.items():
                if not isinstance(value, torch.Tensor):
                    found = by_name[_clean_name(raw_key)]
                    raw[raw_key] = _unflatten([(sub[1:], loaded[fqn]) for fqn, sub in found])
            try:
                module.load_state_dict(raw, strict=True)
            except RuntimeError as e:
                raise CheckpointError(
                    f"checkpoint {path}: module '{key}' rejected the state ({_short(e)})"
                ) from e

        return finish

    def _plan_optimizer(self, path, key, optimizer, ckpt, metadata, flat, by_id):
        sdm = metadata.state_dict_metadata
        names = _optimizer_names(optimizer, by_id)
        params = dict(names)
        wanted: list[tuple[str, tuple]] = []
        for fqn, sub in ckpt:
            if len(sub) >= 2 and sub[0] in ("state", "param_groups") and sub[1] in params:
                md = sdm[fqn]
                if isinstance(md, TensorStorageMetadata):
                    like = params[sub[1]] if sub[0] == "state" and len(sub) == 3 else None
                    flat[fqn] = _alloc(md, like)
                else:
                    flat[fqn] = None
                wanted.append((fqn, sub))
        have_groups = {sub[1] for _, sub in wanted if sub[0] == "param_groups"}
        missing = [name for name, _ in names if name not in have_groups]
        if missing:
            raise self._mismatch(path, key, "optimizer", missing, [], [])
        if self._world_size() == 1:
            held = {sub[1] for fqn, sub in ckpt if len(sub) >= 2}
            unexpected = sorted(held - set(params))
            if unexpected:
                raise self._mismatch(path, key, "optimizer", [], unexpected, [])

        def finish(loaded: dict[str, Any]) -> None:
            nested = _unflatten([(sub, loaded[fqn]) for fqn, sub in wanted])
            state_by_name = nested.get("state", {})
            options_by_name = nested["param_groups"]
            pid = {name: i for i, (name, _) in enumerate(names)}
            state = {pid[name]: value for name, value in state_by_name.items()}
            groups = []
            position = 0
            for group in optimizer.param_groups:
                group_names = [names[position + j][0] for j in range(len(group["params"]))]
                options = {k: v for k, v in group.items() if k not in ("params", "param_names")}
                if group_names:
                    options.update(dict(options_by_name[group_names[0]]))
                options["params"] = [pid[n] for n in group_names]
                if "param_names" in group:
                    options["param_names"] = list(group["param_names"])
                groups.append(options)
                position += len(group["params"])
            try:
                optimizer.load_state_dict({"state": state, "param_groups": groups})
            except (ValueError, KeyError) as e:
                raise CheckpointError(
                    f"checkpoint {path}: optimizer '{key}' rejected the saved state ({_short(e)})"
                ) from e

        return finish

    def _plan_other(self, path, key, obj, ckpt, metadata, flat, app_state):
        sdm = metadata.state_dict_metadata
        stateful = _is_stateful(obj)
        base = obj.state_dict() if stateful else obj
        if isinstance(obj, PerRank):  # read only this rank's entry
            own = obj.rank_key()
            ckpt = [(fqn, sub) for fqn, sub in ckpt if sub[:1] == (own,)]
        base_flat, _ = flatten_state_dict({key: base})
        by_fqn = dict(ckpt)
        missing = [fqn for fqn in base_flat if fqn not in by_fqn]
        if isinstance(obj, PerRank):
            missing = []  # PerRank warns and keeps its state when its rank is absent
        if missing:
            names = [m[len(key) + 1:] or m for m in missing]
            raise self._mismatch(path, key, type(obj).__name__, names, [], [])
        for fqn, sub in ckpt:
            md = sdm[fqn]
            if isinstance(md, TensorStorageMetadata):
                current = base_flat.get(fqn)
                same = (
                    isinstance(current, torch.Tensor)
                    and tuple(current.shape) == tuple(md.size)
                    and current.dtype == md.properties.dtype
                )
                flat[fqn] = current if same else _alloc(md)
            else:
                flat[fqn] = None

        def finish(loaded: dict[str, Any]) -> None:
            if isinstance(obj, PerRank) and not ckpt:
                obj.load_state_dict({})  # warns: nothing saved for this rank
                return
            if not ckpt:
                value = {} if isinstance(base, dict) else base
            else:
                value = _unflatten([(sub, loaded[fqn]) for fqn, sub in ckpt])
            merged = _merge(base, value)
            if stateful:
                obj.load_state_dict(merged)
            elif isinstance(obj, dict) and isinstance(merged, dict):
                obj.clear()
                obj.update(merged)
            elif isinstance(obj, list) and isinstance(merged, list):
                obj[:] = merged
            elif (
                isinstance(obj, torch.Tensor) and isinstance(merged, torch.Tensor)
                and obj.shape == merged.shape and obj.dtype == merged.dtype
            ):
                if merged is not obj:
                    obj.copy_(merged)
            else:
                app_state[key] = merged

        return finish
