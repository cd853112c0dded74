"""State conversion for DCP: module and optimizer state dicts keyed by name (not position), the
nested/flat value helpers used when loading, and the flat-dict DCP load planner."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from k3train.checkpoint.errors import CheckpointError
from k3train.checkpoint.values import decode_value

_WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.")


def is_stateful(obj: Any) -> bool:
    """Whether `obj` has `state_dict()` and `load_state_dict()` (saved through them)."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def clean_name(name: str) -> str:
    """A module state-dict key without `torch.compile`/activation-checkpoint wrapper prefixes."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def module_state(module: nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
    """(raw state dict, the same values under cleaned keys)."""
    raw = module.state_dict()
    clean: dict[str, Any] = {}
    for key, value in raw.items():
        name = clean_name(key)
        if name in clean:
            raise CheckpointError(f"two state-dict keys of the module map to {name!r}")
        clean[name] = value
    return raw, clean


def parameter_names(app_state: dict[str, Any]) -> dict[int, str]:
    """id(parameter) -> checkpoint name `<app key>.<parameter name>` for every module in app_state."""
    names: dict[int, str] = {}
    for key, obj in app_state.items():
        if isinstance(obj, nn.Module):
            for name, param in obj.named_parameters():
                names.setdefault(id(param), f"{key}.{clean_name(name)}")
    return names


def optimizer_param_names(optimizer: torch.optim.Optimizer, by_id: dict[int, str]) -> list[tuple[str, torch.Tensor]]:
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
    names = [name for name, _ in optimizer_param_names(optimizer, by_id)]
    osd = optimizer.state_dict()
    state = {names[pid]: value for pid, value in osd["state"].items()}
    groups: dict[str, tuple[tuple[str, Any], ...]] = {}
    for group in osd["param_groups"]:
        # One value per parameter (a tuple is never split by DCP), not one per option.
        options = tuple((k, v) for k, v in group.items() if k not in ("params", "param_names"))
        for pid in group["params"]:
            groups[names[pid]] = options
    return {"state": state, "param_groups": groups}


def saveable_state(obj: Any, by_id: dict[int, str]) -> Any:
    """What is saved for one app_state value (docs/checkpoints.md, "What is saved")."""
    if isinstance(obj, nn.Module):
        return module_state(obj)[1]
    if isinstance(obj, torch.optim.Optimizer):
        return _optimizer_state(obj, by_id)
    if is_stateful(obj):
        return obj.state_dict()
    return obj


def _set_path(root: dict, path: tuple, value: Any) -> None:
    """Set `value` at `path` below `root`, creating dicts (str keys) and lists (int keys)."""
    node: Any = root
    for i, key in enumerate(path):
        last = i == len(path) - 1
        nxt: Any = None if last else ({} if isinstance(path[i + 1], str) else [])
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


def unflatten(items: list[tuple[tuple, Any]]) -> Any:
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


def merge_loaded(base: Any, loaded: Any) -> Any:
    """`loaded` over `base`: dicts merge key by key (keeping base-only keys, e.g. empty dicts DCP
    does not store), everything else is taken from `loaded`."""
    if isinstance(base, dict) and isinstance(loaded, dict):
        out = dict(base)
        base_keys = {str(k): k for k in base}  # DCP returns dict keys as strings: keep base's
        for k, v in loaded.items():
            bk = base_keys.get(str(k), k)
            out[bk] = merge_loaded(base[bk], v) if bk in base else v
        return out
    return loaded


def empty_tensor_for(md: TensorStorageMetadata, like: torch.Tensor | None = None) -> torch.Tensor:
    """A tensor to read a saved tensor into: on `like`'s device and layout when the shapes agree."""
    dtype = md.properties.dtype
    if like is not None and tuple(like.shape) == tuple(md.size):
        return torch.zeros_like(like, dtype=dtype)  # same device (and DTensor layout) as `like`
    return torch.empty(tuple(md.size), dtype=dtype)


class FlatLoadPlanner(DefaultLoadPlanner):
    """Loads an already flat dict (keys = DCP's flat keys, flattening off). Tensors are read in
    place; non-tensor values (JSON, `values.py`) go into `target` (`dcp.load` would overwrite them in the dict it was
    given with the placeholders of its own copy)."""

    def __init__(self, target: dict[str, Any]) -> None:
        super().__init__(flatten_state_dict=False)
        self._target = target

    def load_bytes(self, read_item: Any, value: Any) -> None:
        fqn = read_item.dest_index.fqn
        self._target[fqn] = decode_value(value.read(), f"checkpoint value {fqn}")  # JSON, never a pickle
