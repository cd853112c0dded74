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
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import random
import re
import secrets
import shutil
import signal
import threading
import time
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
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

logger = logging.getLogger(__name__)

MANIFEST = "k3train.json"
METADATA = ".metadata"
FORMAT = "k3train-dcp"
FORMAT_VERSION = 1
STEP_PREFIX = "step_"
TMP_PREFIX = ".tmp_"
OLD_PREFIX = ".old_"
_STEP_RE = re.compile(r"^step_(\d+)$")
_OLD_RE = re.compile(r"^\.old_(step_\d+)_[0-9a-f]+$")
_WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.")
_MAX_LISTED = 5


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: missing, incomplete, truncated or not matching the model."""


# --------------------------------------------------------------------------------------------
# Paths, manifest, verification


def step_dir_name(step: int) -> str:
    """`step_00000010` for step 10 (eight digits, more when the step needs them)."""
    if step < 0:
        raise ValueError(f"step must be >= 0 (got {step})")
    return f"{STEP_PREFIX}{step:08d}"


def read_manifest(path: str | Path) -> Optional[dict]:
    """The manifest of a checkpoint directory, or None when it is missing or unreadable."""
    try:
        with open(Path(path) / MANIFEST, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def is_complete(path: str | Path) -> bool:
    """True when `path` holds DCP's `.metadata` and a manifest marked complete (cheap: no data read)."""
    path = Path(path)
    if not (path / METADATA).is_file():
        return False
    manifest = read_manifest(path)
    return bool(manifest and manifest.get("complete") is True)


def write_manifest(path: str | Path, step: int, world_size: int = 1, **extra: Any) -> None:
    """Write `k3train.json` into a finished DCP directory (atomically, fsynced).

    `Checkpointer.save` calls this; a converter that writes a DCP checkpoint by other means calls
    it last to make the directory a complete checkpoint.
    """
    path = Path(path)
    now = time.time()
    manifest = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "step": int(step),
        "time": datetime.datetime.fromtimestamp(now, datetime.timezone.utc).isoformat(),
        "unix_time": now,
        "torch_version": torch.__version__,
        "world_size": int(world_size),
        **extra,
        "complete": True,
    }
    tmp = path / (MANIFEST + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path / MANIFEST)
    _fsync_dir(path)


def _fix_hint(path: Path) -> str:
    return f"delete {path} or pass checkpoint.resume=<another checkpoint> (or checkpoint.resume=none)"


def verify_checkpoint(path: str | Path) -> Metadata:
    """Check that `path` is a complete, untruncated checkpoint; return its DCP metadata.

    Reads `.metadata` and compares every data file it names with the bytes it needs (missing and
    short files are found here, before DCP reads anything). Raises `CheckpointError`.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(
            f"checkpoint {path} does not exist; pass checkpoint.resume=<a complete checkpoint "
            "directory>, auto (newest in checkpoint.dir) or none"
        )
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} is not a directory; {_fix_hint(path)}")
    if not (path / METADATA).is_file():
        raise CheckpointError(
            f"checkpoint {path} is incomplete: no {METADATA} (its save did not finish); {_fix_hint(path)}"
        )
    manifest = read_manifest(path)
    if not manifest or manifest.get("complete") is not True:
        raise CheckpointError(
            f"checkpoint {path} is incomplete: no {MANIFEST} marked complete (its save did not "
            f"finish); {_fix_hint(path)}"
        )
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # unpickling a damaged file can raise almost anything
        raise CheckpointError(
            f"checkpoint {path} has an unreadable {METADATA} ({type(e).__name__}: {_short(e)}); "
            f"{_fix_hint(path)}"
        ) from None
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if rel is None:
            continue
        end = int(getattr(info, "offset", 0)) + int(getattr(info, "length", 0))
        needed[rel] = max(needed.get(rel, 0), end)
    for rel, size in sorted(needed.items()):
        file = path / rel
        if not file.is_file():
            raise CheckpointError(
                f"checkpoint {path} is incomplete: data file {rel} is missing; {_fix_hint(path)}"
            )
        actual = file.stat().st_size
        if actual < size:
            raise CheckpointError(
                f"checkpoint {path} is truncated: data file {rel} has {actual} bytes, "
                f"{METADATA} needs {size}; {_fix_hint(path)}"
            )
    return metadata


def _short(e: BaseException, limit: int = 300) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _describe(e: BaseException) -> str:
    """One line per failure; DCP's CheckpointException (a BaseException) carries one per rank."""
    if isinstance(e, CheckpointException):
        parts = []
        for rank, wrapped in sorted(e.failures.items()):
            inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
            parts.append(f"rank {rank}: {type(inner).__name__}: {_short(inner, 200)}")
        return "; ".join(parts) or "CheckpointException"
    return f"{type(e).__name__}: {_short(e)}"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _listing(keys: Iterable[str], total: Optional[int] = None) -> str:
    keys = list(keys)
    total = len(keys) if total is None else total
    shown = ", ".join(keys[:_MAX_LISTED])
    return f"{shown}{', ...' if total > _MAX_LISTED else ''} ({total} in all)"


# --------------------------------------------------------------------------------------------
# Process group helpers


def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def _global_rank() -> int:
    return dist.get_rank() if _dist_on() else 0


# --------------------------------------------------------------------------------------------
# RNG state


def capture_rng_state() -> dict[str, Any]:
    """This process's RNG streams: torch CPU, CUDA (every device, if CUDA is initialised), Python
    `random` and numpy's global generator (if numpy is installed).

    The torch states are uint8 tensors (saved as tensors); the Python and numpy states are
    tuples (saved as pickled bytes).
    """
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is a dependency
        pass
    else:
        state["numpy"] = np.random.get_state()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Set the RNG streams captured by `capture_rng_state` (streams absent from `state` are left)."""
    if "torch" in state:
        torch.set_rng_state(torch.as_tensor(state["torch"], dtype=torch.uint8).cpu())
    if "python" in state:
        py = state["python"]
        # A pickled tuple comes back as a tuple; be lenient with a list-ified state.
        if isinstance(py, list):
            py = (py[0], tuple(py[1]), py[2])
        random.setstate(py)
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        saved = [torch.as_tensor(s, dtype=torch.uint8).cpu() for s in state["cuda"]]
        count = torch.cuda.device_count()
        if len(saved) != count:
            warnings.warn(
                f"checkpoint holds CUDA RNG states for {len(saved)} devices, this process sees "
                f"{count}; restoring the first {min(len(saved), count)}",
                stacklevel=2,
            )
        for device, s in enumerate(saved[:count]):
            torch.cuda.set_rng_state(s, device)


class PerRank:
    """Save `obj` (a dict or an object with `state_dict`/`load_state_dict`) under this process's
    global rank: `<app_state key>.rank_<r>.*`, so ranks whose values differ do not collide (DCP
    keeps one copy of a key that several ranks save). Loading reads only this rank's entry; a rank
    the checkpoint has no entry for keeps its current state and warns."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    @staticmethod
    def rank_key(rank: Optional[int] = None) -> str:
        return f"rank_{_global_rank() if rank is None else rank}"

    def state_dict(self) -> dict[str, Any]:
        inner = self.obj.state_dict() if _is_stateful(self.obj) else self.obj
        return {self.rank_key(): inner}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        key = self.rank_key()
        if key not in state_dict:
            warnings.warn(
                f"checkpoint has no {type(self.obj).__name__} state for {key} (it holds "
                f"{sorted(state_dict) or 'none'}); keeping this rank's current state",
                stacklevel=2,
            )
            return
        value = state_dict[key]
        if _is_stateful(self.obj):
            self.obj.load_state_dict(value)
        elif isinstance(self.obj, dict):
            self.obj.clear()
            self.obj.update(value)
        else:
            self.obj = value


class _ProcessRNG:
    def state_dict(self) -> dict[str, Any]:
        return capture_rng_state()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        restore_rng_state(state_dict)


class RNGState(PerRank):
    """Put `RNGState()` into `app_state` to save and restore every rank's RNG streams."""

    def __init__(self) -> None:
        super().__init__(_ProcessRNG())


# --------------------------------------------------------------------------------------------
# Graceful exit on SIGTERM / SIGINT


class GracefulExit:
    """While active, SIGTERM and SIGINT set `should_stop` instead of ending the process, so the
    training loop can save a checkpoint and return. A second SIGINT raises KeyboardInterrupt (two
    Ctrl-C still stop a stuck job). Previous handlers are restored on exit.

        with GracefulExit() as stop:
            for step in ...:
                ...
                if stop.requested(process_group):   # any rank signalled -> every rank stops
                    checkpointer.save(step, app_state); break

    Signal handlers can only be installed from the main thread; elsewhere this warns and the flag
    stays False.
    """

    def __init__(self, signals: Iterable[int] = (signal.SIGTERM, signal.SIGINT)) -> None:
        self.signals = tuple(signals)
        self.should_stop = False
        self.received: Optional[int] = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.should_stop and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.should_stop = True
        self.received = signum
        logger.warning(
            "received %s: finishing the step, saving a checkpoint and exiting",
            signal.Signals(signum).name,
        )

    def __enter__(self) -> "GracefulExit":
        if threading.current_thread() is not threading.main_thread():
            warnings.warn("GracefulExit: not the main thread, signal handlers not installed", stacklevel=2)
            return self
        for sig in self.signals:
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> bool:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
        return False

    def requested(self, process_group: Any = None) -> bool:
        """`should_stop` agreed over the process group (True if any rank got a signal)."""
        if not _dist_on():
            return self.should_stop
        flag = torch.tensor([1 if self.should_stop else 0], dtype=torch.int32)
        if dist.get_backend(process_group) == "nccl":
            flag = flag.cuda()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=process_group)
        return bool(flag.item())


# --------------------------------------------------------------------------------------------
# State conversion


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _clean_name(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _module_state(module: nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
    """(raw state dict, the same values under cleaned keys)."""
    raw = module.state_dict()
    clean: dict[str, Any] = {}
    for key, value in raw.items():
        name = _clean_name(key)
        if name in clean:
            raise CheckpointError(f"two state-dict keys of the module map to {name!r}")
        clean[name] = value
    return raw, clean


def _param_names(app_state: dict[str, Any]) -> dict[int, str]:
    """id(parameter) -> checkpoint name `<app key>.<parameter name>` for every module in app_state."""
    names: dict[int, str] = {}
    for key, obj in app_state.items():
        if isinstance(obj, nn.Module):
            for name, param in obj.named_parameters():
                names.setdefault(id(param), f"{key}.{_clean_name(name)}")
    return names


def _optimizer_names(
    optimizer: torch.optim.Optimizer, by_id: dict[int, str]
) -> list[tuple[str, torch.Tensor]]:
    """(checkpoint name, parameter) in the optimizer's positional order."""
    out = []
    for gi, group in enumerate(optimizer.param_groups):
        group_names = group.get("param_names")
        for pi, param in enumerate(group["params"]):
            name = by_id.get(id(param))
            if name is None:
                name = group_names[pi] if group_names else f"group{gi}.param{pi}"
            out.append((name, param))
    seen: set[str] = set()
    for name, _ in out:
        if name in seen:
            raise CheckpointError(f"optimizer parameter name {name!r} occurs twice")
        seen.add(name)
    return out


def _optimizer_state(optimizer: torch.optim.Optimizer, by_id: dict[int, str]) -> dict[str, Any]:
    names = [name for name, _ in _optimizer_names(optimizer, by_id)]
    osd = optimizer.state_dict()
    state = {names[pid]: value for pid, value in osd["state"].items()}
    groups: dict[str, dict[str, Any]] = {}
    for group in osd["param_groups"]:
        # One pickled entry per parameter (a tuple is never split by DCP), not one per option.
        options = tuple((k, v) for k, v in group.items() if k not in ("params", "param_names"))
        for pid in group["params"]:
            groups[names[pid]] = options
    return {"state": state, "param_groups": groups}


def _saveable(key: str, obj: Any, by_id: dict[int, str]) -> Any:
    if isinstance(obj, nn.Module):
        return _module_state(obj)[1]
    if isinstance(obj, torch.optim.Optimizer):
        return _optimizer_state(obj, by_id)
    if _is_stateful(obj):
        return obj.state_dict()
    return obj


def _set_path(root: dict, path: tuple, value: Any) -> None:
    """Set `value` at `path` below `root`, creating dicts (str keys) and lists (int keys)."""
    node: Any = root
    for i, key in enumerate(path):
        last = i == len(path) - 1
        nxt = None if last else ({} if isinstance(path[i + 1], str) else [])
        if isinstance(node, list):
            while len(node) <= key:
                node.append(None)
            if last:
                node[key] = value
            else:
                if node[key] is None:
                    node[key] = nxt
                node = node[key]
        else:
            if last:
                node[key] = value
            else:
                node = node.setdefault(key, nxt)


def _unflatten(items: list[tuple[tuple, Any]]) -> Any:
    """Nested value from (path below the app_state key, value); a path () is the value itself."""
    for path, value in items:
        if path == ():
            return value
    if not items:
        return {}
    root: Any = [] if isinstance(items[0][0][0], int) else {}
    for path, value in items:
        _set_path(root, path, value)
    return root


def _merge(base: Any, loaded: Any) -> Any:
    """`loaded` over `base`: dicts merge key by key (keeping base-only keys, e.g. empty dicts DCP
    does not store), everything else is taken from `loaded`."""
    if isinstance(base, dict) and isinstance(loaded, dict):
        out = dict(base)
        base_keys = {str(k): k for k in base}  # DCP returns dict keys as strings: keep base's
        for k, v in loaded.items():
            bk = base_keys.get(str(k), k)
            out[bk] = _merge(base[bk], v) if bk in base else v
        return out
    return loaded


def _alloc(md: TensorStorageMetadata, like: Optional[torch.Tensor] = None) -> torch.Tensor:
    dtype = md.properties.dtype
    if like is not None and tuple(like.shape) == tuple(md.size):
        return torch.zeros_like(like, dtype=dtype)  # same device (and DTensor layout) as `like`
    return torch.empty(tuple(md.size), dtype=dtype)


class _FlatLoadPlanner(DefaultLoadPlanner):
    """Loads an already flat dict (keys = DCP's flat keys, flattening off). Tensors are read in
    place; non-tensor values go into `target` (`dcp.load` would overwrite them in the dict it was
    given with the placeholders of its own copy)."""

    def __init__(self, target: dict[str, Any]) -> None:
        super().__init__(flatten_state_dict=False)
        self._target = target

    def load_bytes(self, read_item: Any, value: Any) -> None:
        self._target[read_item.dest_index.fqn] = torch.load(value, weights_only=False)


# --------------------------------------------------------------------------------------------
# The checkpointer


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
