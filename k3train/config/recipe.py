"""Strict YAML recipes for a tree of dataclasses: loading, `key=value` overrides, saving.

A recipe is a YAML mapping of the root dataclass's fields; nested dataclasses nest in YAML and
take more dots on the command line (`model.linear_attn_config.num_heads=8`). Loading is strict:
an unknown key, a wrong type or an inconsistent combination is a `ConfigError` whose message
names the field, the file or override it came from, and what would be accepted. Generic: the
root class is a parameter (k3train's is `JobConfig`, in `k3train/config/job.py`), and a field added to
any dataclass in the tree is loadable and overridable without touching this module. After
loading, the root's `validate()` runs once.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

import yaml

from k3train.config.typed_fields import (
    FieldMismatch,
    coerce,
    field_types,
    leaf_keys,
    nested_dataclass,
    plain,
    type_name,
    union_args,
)
from k3train.errors import UserError

__all__ = ["ConfigError", "check", "from_mapping", "load_recipe", "save_recipe", "to_mapping", "with_overrides"]

Config = TypeVar("Config")


class ConfigError(UserError, ValueError):
    """A recipe, override or combination of fields that cannot be used; the message says which
    field, where it came from, and how to fix it (one line, or a few short ones)."""


def check(checks: Iterable[tuple[bool, str]]) -> None:
    """Raise ConfigError with the message of the first failed (ok, message) pair."""
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)


# ---------------------------------------------------------------- applying values


def _mismatch_message(mismatch: FieldMismatch, where: str) -> str:
    given = "null" if mismatch.value is None else repr(mismatch.value)
    hint = f"; {mismatch.hint}" if mismatch.hint else ""
    return f"{where}: {mismatch.key} expects {type_name(mismatch.tp)}, got {given}{hint}"


def _unknown_key_message(root: type, dotted: str, where: str) -> str:
    """'unknown key' with the closest valid keys: the same field name in another section first (a
    field put in the wrong section is a common slip), then siblings spelled alike, then any key of
    the same depth spelled alike."""
    all_keys = leaf_keys(root)
    parent, _, leaf = dotted.rpartition(".")
    siblings = {k.rpartition(".")[2]: k for k in all_keys if k.rpartition(".")[0] == parent}
    same_depth = [k for k in all_keys if k.count(".") == dotted.count(".")]
    suggestions = [k for k in all_keys if k.rpartition(".")[2] == leaf]
    suggestions += [siblings[name] for name in difflib.get_close_matches(leaf, list(siblings), n=3, cutoff=0.6)]
    suggestions += difflib.get_close_matches(dotted, same_depth, n=3, cutoff=0.8)
    unique = list(dict.fromkeys(suggestions))[:3]
    if unique:
        fix = "did you mean " + (", ".join(unique[:-1]) + " or " if len(unique) > 1 else "") + unique[-1] + "?"
    else:
        # List what exists at the first level of the key that does not exist.
        parts = dotted.split(".")
        depth = next((i for i in range(len(parts)) if ".".join(parts[: i + 1]) not in all_keys), len(parts) - 1)
        level = ".".join(parts[:depth])
        names = [k.rpartition(".")[2] for k in all_keys if k.rpartition(".")[0] == level]
        fix = (
            f"valid keys{' under ' + level if level else ''}: {', '.join(names)}"
            if names
            else f"{level} is a field, not a section"
        )
    return f"{where}: unknown key '{dotted}'; {fix}"


def _resolve_value(root: type, current: Any, tp: Any, value: Any, dotted: str, where: str, raw: str | None) -> Any:
    """The new value of a field: a mapping onto a nested dataclass merges into its current value
    (so a recipe need only name the fields it changes); anything else is coerced to the type."""
    nested = nested_dataclass(tp)
    if nested is not None and value is None and union_args(tp) is None:
        value = {}  # a section whose lines are all commented out reads as null: nothing to change
    if nested is not None and isinstance(value, Mapping):
        base = current if isinstance(current, nested) else nested()
        return _apply_mapping(root, base, value, dotted, where)
    if nested is not None and value is not None:
        raise ConfigError(
            f"{where}: {dotted} is a section; give a mapping of its fields "
            f"(e.g. {leaf_keys(nested, dotted + '.')[0]}=...)"
        )
    try:
        return coerce(value, tp, dotted, raw)
    except FieldMismatch as mismatch:
        raise ConfigError(_mismatch_message(mismatch, where)) from None


def _apply_mapping(root: type, obj: Any, mapping: Mapping, prefix: str, where: str = "") -> Any:
    """Set the fields of dataclass instance `obj` from `mapping` (in place); return `obj`."""
    types_by_name = field_types(type(obj))
    for key, value in mapping.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if not isinstance(key, str) or key not in types_by_name:
            raise ConfigError(_unknown_key_message(root, dotted, where))
        setattr(obj, key, _resolve_value(root, getattr(obj, key), types_by_name[key], value, dotted, where, None))
    return obj


# ---------------------------------------------------------------- reading YAML


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys (PyYAML silently keeps the last one, which hides a
    recipe's typo'd copy-paste)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set[str] = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                if key_node.value in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key '{key_node.value}'", key_node.start_mark
                    )
                seen.add(key_node.value)
        return super().construct_mapping(node, deep)


def _yaml_error_message(error: yaml.YAMLError, where: str) -> str:
    if isinstance(error, yaml.MarkedYAMLError) and error.problem_mark is not None:
        mark, context = error.problem_mark, ""
        if error.context and error.context_mark is not None:
            context = f" ({error.context} at line {error.context_mark.line + 1})"
        return f"{where}: invalid YAML at line {mark.line + 1}, column {mark.column + 1}: {error.problem}{context}"
    return f"{where}: invalid YAML: {' '.join(str(error).split())}"


def _read_recipe(root: type, path: str) -> Mapping:
    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml.load(handle, Loader=_StrictLoader)
    except FileNotFoundError:
        raise ConfigError(f"recipe {path} not found; pass an existing YAML file to --recipe") from None
    except OSError as error:
        raise ConfigError(f"recipe {path} cannot be read: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise ConfigError(_yaml_error_message(error, path)) from None
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"{path}: a recipe must be a mapping of sections ({', '.join(field_types(root))}), "
            f"got {type(data).__name__}"
        )
    return data


def _apply_override(config: Any, item: str) -> None:
    """Apply one `section.field=value` override to config in place."""
    root = type(config)
    where = f"override '{item}'"
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"{where} is not of the form section.field=value (e.g. train.steps=50)")
    try:
        value = yaml.load(text, Loader=_StrictLoader) if text.strip() else None
    except yaml.YAMLError as error:
        raise ConfigError(_yaml_error_message(error, where)) from None

    *parents, name = key.split(".")
    obj: Any = config
    for part in parents:
        child = getattr(obj, part, None) if part in field_types(type(obj)) else None
        if not dataclasses.is_dataclass(child):
            raise ConfigError(_unknown_key_message(root, key, where))
        obj = child
    types_by_name = field_types(type(obj))
    if name not in types_by_name:
        raise ConfigError(_unknown_key_message(root, key, where))
    setattr(obj, name, _resolve_value(root, getattr(obj, name), types_by_name[name], value, key, where, text))


def _validated(config: Config, source: str) -> Config:
    """Run the root's `validate()` once; its ConfigError gains the source as a prefix."""
    validate = getattr(config, "validate", None)
    if callable(validate):
        try:
            validate()
        except ConfigError as error:
            raise ConfigError(f"{source}: {error}") from None
    return config


# ---------------------------------------------------------------- the public operations


def load_recipe(root: type[Config], recipe_path: str | None, overrides: Sequence[str] = ()) -> Config:
    """`root()`'s defaults, then the recipe (if any), then the overrides in order; validated.

    Raises ConfigError for a missing or malformed recipe, an unknown key, a value of the wrong
    type or an inconsistent combination of fields.
    """
    config = root()
    if recipe_path is not None:
        _apply_mapping(root, config, _read_recipe(root, recipe_path), "", recipe_path)
    for item in overrides:
        _apply_override(config, item)
    return _validated(config, (recipe_path or "defaults") + (" with overrides" if overrides else ""))


def with_overrides(config: Config, overrides: Sequence[str]) -> Config:
    """A validated copy of config with `section.field=value` overrides applied in order (each value
    parsed as YAML, then coerced to the field's type)."""
    config = copy.deepcopy(config)
    for item in overrides:
        _apply_override(config, item)
    return _validated(config, "overrides")


def from_mapping(root: type[Config], data: Mapping, source: str = "config") -> Config:
    """A validated `root` from a mapping of sections (as `to_mapping` writes); fields left out keep
    their defaults. `source` names the origin in error messages."""
    return _validated(_apply_mapping(root, root(), data, "", source), source)


def to_mapping(config: Any) -> dict[str, Any]:
    """A config as nested builtins (sections → fields), loadable by `from_mapping`."""
    return plain(config)


class _RecipeDumper(yaml.SafeDumper):
    """Block-style mappings with lists on one line, the way the hand-written recipes look."""


_RecipeDumper.add_representer(
    list, lambda dumper, data: dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=True)
)


def save_recipe(config: Any, path: str, header: str = "") -> None:
    """Write a config as a YAML recipe, after the comment lines in `header`, atomically (a reader
    never sees half a file)."""
    text = header + yaml.dump(to_mapping(config), Dumper=_RecipeDumper, sort_keys=False)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    handle, tmp_path = tempfile.mkstemp(dir=directory, prefix=".config-", suffix=".yaml.tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(text)
        os.chmod(tmp_path, 0o644)  # mkstemp creates 0600; a config is for everyone to read
        os.replace(tmp_path, path)
    except BaseException:
        if os.path.exists(tmp_path):
            os.unlink(tmp_path)
        raise
