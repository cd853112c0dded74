"""What a load reads and how each `app_state` value takes it back: the flat DCP load target, the
checks that the checkpoint matches the modules and optimizers it is loaded into, and one finishing
step per value that puts the loaded state in place (docs/checkpoints.md, "What is saved")."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from k3train.checkpoint.errors import CheckpointError, one_line
from k3train.checkpoint.manifest import resume_hint
from k3train.checkpoint.rng import PerRank
from k3train.checkpoint.state import (
    clean_name,
    empty_tensor_for,
    is_stateful,
    merge_loaded,
    module_state,
    optimizer_param_names,
    parameter_names,
    unflatten,
)

_MAX_LISTED = 5

Entries = list[tuple[str, tuple]]
"""(DCP flat key, path of the value below its app_state key) of the tensors/values one key saved."""
Finisher = Callable[[dict[str, Any]], None]


@dataclass
class LoadTarget:
    """What one `dcp.load` fills, and what to do with it afterwards."""

    flat: dict[str, Any] = field(default_factory=dict)
    """DCP's flat load target: tensors are read in place; pickled values are placeholders (None)."""
    finishers: list[Finisher] = field(default_factory=list)
    """One per app_state key, in order: puts the loaded values into the object."""

    def finish(self, loaded_values: dict[str, Any]) -> None:
        """Put everything in place once DCP has read the tensors and `loaded_values` (the
        unpickled non-tensor values by flat key)."""
        self.flat.update(loaded_values)
        for finish in self.finishers:
            finish(self.flat)


def plan_load(path: Path, metadata: Metadata, app_state: dict[str, Any], world_size: int) -> LoadTarget:
    """The load target of checkpoint `path` (its verified `metadata`) for `app_state`.

    With `world_size` 1 every saved key must have a place in the modules/optimizers; under
    pipeline or expert parallelism a rank holds part of the model, so keys only others load are
    expected. Raises `CheckpointError` for missing keys and shape mismatches.
    """
    mapping: dict[str, tuple] = dict(metadata.planner_data or {})
    for fqn in metadata.state_dict_metadata:
        if fqn not in mapping:  # a checkpoint written without DCP's flattening planner
            head, _, tail = fqn.partition(".")
            mapping[fqn] = (head, tail) if tail else (head,)
    entries: dict[str, Entries] = {}
    for fqn, p in mapping.items():
        if fqn in metadata.state_dict_metadata:
            entries.setdefault(str(p[0]), []).append((fqn, tuple(p[1:])))

    by_id = parameter_names(app_state)
    target = LoadTarget()
    single = world_size == 1
    for key, obj in app_state.items():
        saved = entries.get(key, [])
        if isinstance(obj, nn.Module):
            finish = _plan_module(path, key, obj, saved, metadata, target.flat, single)
        elif isinstance(obj, torch.optim.Optimizer):
            finish = _plan_optimizer(path, key, obj, saved, metadata, target.flat, by_id, single)
        else:
            finish = _plan_value(path, key, obj, saved, metadata, target.flat, app_state)
        target.finishers.append(finish)
    return target


def _listing(keys: Iterable[str]) -> str:
    keys = list(keys)
    shown = ", ".join(keys[:_MAX_LISTED])
    return f"{shown}{', ...' if len(keys) > _MAX_LISTED else ''} ({len(keys)} in all)"


def _mismatch(
    path: Path, key: str, what: str, missing: list[str], unexpected: list[str], shapes: list[str]
) -> CheckpointError:
    parts = []
    if missing:
        parts.append(f"missing in the checkpoint: {_listing(missing)}")
    if unexpected:
        parts.append(f"in the checkpoint but not in the {what}: {_listing(unexpected)}")
    if shapes:
        parts.append(f"shape mismatch (checkpoint vs {what}): {_listing(shapes)}")
    return CheckpointError(
        f"checkpoint {path} does not match {what} '{key}': "
        + "; ".join(parts)
        + ". Was it written for another model configuration?"
    )


def is_extra_state(name: str) -> bool:
    """A module's `get_extra_state()` entry (Transformer Engine's FP8 state), not a parameter."""
    return name == "_extra_state" or name.endswith("._extra_state")


def _plan_module(
    path: Path, key: str, module: nn.Module, saved: Entries, metadata: Metadata, flat: dict[str, Any], single: bool
) -> Finisher:
    raw, clean = module_state(module)
    sdm = metadata.state_dict_metadata
    by_name: dict[str, Entries] = {}
    for fqn, sub in saved:
        by_name.setdefault(str(sub[0]) if sub else "", []).append((fqn, sub))
    missing, shapes, absent_extra = [], [], set()
    for name, value in clean.items():
        found = by_name.get(name)
        if not found:
            if is_extra_state(name):  # saved by another linear backend: the module keeps its own
                absent_extra.add(name)
                continue
            missing.append(name)
            continue
        if isinstance(value, torch.Tensor) and is_extra_state(name):
            # FP8 scaling state as a flat tensor (kernels/te.py): whatever length was saved
            # (empty under bf16), so checkpoints move between bf16 and fp8 runs.
            for fqn, _ in found:
                md = sdm[fqn]
                flat[fqn] = empty_tensor_for(md) if isinstance(md, TensorStorageMetadata) else None
        elif isinstance(value, torch.Tensor):
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
                flat[fqn] = empty_tensor_for(md) if isinstance(md, TensorStorageMetadata) else None
    unexpected = sorted(name for name in by_name if name not in clean and not is_extra_state(name)) if single else []
    if missing or unexpected or shapes:
        raise _mismatch(path, key, "module", missing, unexpected, shapes)

    def finish(loaded: dict[str, Any]) -> None:
        for raw_key, value in raw.items():
            name = clean_name(raw_key)
            if name in absent_extra:
                continue  # the module's own (fresh) extra state stays
            if not isinstance(value, torch.Tensor) or is_extra_state(name):
                found = by_name[name]
                raw[raw_key] = unflatten([(sub[1:], loaded[fqn]) for fqn, sub in found])
        try:
            module.load_state_dict(raw, strict=True)
        except RuntimeError as e:
            raise CheckpointError(f"checkpoint {path}: module '{key}' rejected the state ({one_line(e)})") from e

    return finish


def _plan_optimizer(
    path: Path,
    key: str,
    optimizer: torch.optim.Optimizer,
    saved: Entries,
    metadata: Metadata,
    flat: dict[str, Any],
    by_id: dict[int, str],
    single: bool,
) -> Finisher:
    sdm = metadata.state_dict_metadata
    names = optimizer_param_names(optimizer, by_id)
    params = dict(names)
    wanted: Entries = []
    for fqn, sub in saved:
        if len(sub) >= 2 and sub[0] in ("state", "param_groups") and sub[1] in params:
            md = sdm[fqn]
            if isinstance(md, TensorStorageMetadata):
                like = params[sub[1]] if sub[0] == "state" and len(sub) == 3 else None
                flat[fqn] = empty_tensor_for(md, like)
            else:
                flat[fqn] = None
            wanted.append((fqn, sub))
    have_groups = {sub[1] for _, sub in wanted if sub[0] == "param_groups"}
    missing = [name for name, _ in names if name not in have_groups]
    if missing:
        raise _mismatch(path, key, "optimizer", missing, [], [])
    if single:
        held = {sub[1] for fqn, sub in saved if len(sub) >= 2}
        unexpected = sorted(held - set(params))
        if unexpected:
            raise _mismatch(path, key, "optimizer", [], unexpected, [])

    def finish(loaded: dict[str, Any]) -> None:
        nested = unflatten([(sub, loaded[fqn]) for fqn, sub in wanted])
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
                f"checkpoint {path}: optimizer '{key}' rejected the saved state ({one_line(e)})"
            ) from e

    return finish


def _plan_value(
    path: Path, key: str, obj: Any, saved: Entries, metadata: Metadata, flat: dict[str, Any], app_state: dict[str, Any]
) -> Finisher:
    """A stateful object (merged into its current state) or a plain value (updated in place
    where it is a dict, list or tensor; replaced in `app_state` otherwise)."""
    sdm = metadata.state_dict_metadata
    stateful = is_stateful(obj)
    base = obj.state_dict() if stateful else obj
    if isinstance(obj, PerRank):  # read only this rank's entry
        own = obj.rank_key()
        saved = [(fqn, sub) for fqn, sub in saved if sub[:1] == (own,)]
    base_flat, _ = flatten_state_dict({key: base})
    by_fqn = dict(saved)
    missing = [fqn for fqn in base_flat if fqn not in by_fqn]
    if isinstance(obj, PerRank):
        missing = []  # PerRank warns and keeps its state when its rank is absent
    if missing:
        names = [m[len(key) + 1 :] or m for m in missing]
        raise _mismatch(path, key, type(obj).__name__, names, [], [])
    for fqn, _ in saved:
        md = sdm[fqn]
        if isinstance(md, TensorStorageMetadata):
            current = base_flat.get(fqn)
            same = (
                isinstance(current, torch.Tensor)
                and tuple(current.shape) == tuple(md.size)
                and current.dtype == md.properties.dtype
            )
            flat[fqn] = current if same else empty_tensor_for(md)
        else:
            flat[fqn] = None

    def finish(loaded: dict[str, Any]) -> None:
        if isinstance(obj, PerRank) and not saved:
            obj.load_state_dict({})  # warns: nothing saved for this rank
            return
        value = (
            ({} if isinstance(base, dict) else base)
            if not saved
            else unflatten([(sub, loaded[fqn]) for fqn, sub in saved])
        )
        merged = merge_loaded(base, value)
        if stateful:
            try:
                obj.load_state_dict(merged)
            except (ValueError, TypeError, KeyError, IndexError, RuntimeError) as e:  # damaged or crafted values
                raise CheckpointError(
                    f"checkpoint {path}: the saved '{key}' state is not valid ({type(e).__name__}: {one_line(e)}); "
                    f"{resume_hint(path)}"
                ) from None
        elif isinstance(obj, dict) and isinstance(merged, dict):
            obj.clear()
            obj.update(merged)
        elif isinstance(obj, list) and isinstance(merged, list):
            obj[:] = merged
        elif (
            isinstance(obj, torch.Tensor)
            and isinstance(merged, torch.Tensor)
            and obj.shape == merged.shape
            and obj.dtype == merged.dtype
        ):
            if merged is not obj:
                obj.copy_(merged)
        else:
            app_state[key] = merged

    return finish
