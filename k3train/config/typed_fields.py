"""Typed fields of dataclasses: their resolved types, attribute docstrings and readable type
names, and the coercion of YAML values to those types.

Generic: it walks any dataclass tree and knows nothing of k3train's sections; the recipe loader
(`k3train/config/recipe.py`) and the docs generator (`k3train/config/reference.py`) build on it.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import math
import textwrap
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, Union

__all__ = [
    "FieldMismatch",
    "coerce",
    "field_docs",
    "field_types",
    "is_dataclass_type",
    "leaf_keys",
    "nested_dataclass",
    "plain",
    "type_name",
    "union_args",
]


def is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def field_types(cls: type) -> dict[str, Any]:
    """Resolved type of every init field of a dataclass, in declaration order.

    `typing.get_type_hints` resolves string annotations (modules using
    `from __future__ import annotations`) in the defining module's namespace.
    """
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def union_args(tp: Any) -> tuple[Any, ...] | None:
    """The members of a `Union[...]`/`X | Y` type, or None for any other type."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        return typing.get_args(tp)
    return None


def nested_dataclass(tp: Any) -> type | None:
    """The dataclass a field holds (directly or as Optional[...]), else None."""
    if is_dataclass_type(tp):
        return tp
    members = union_args(tp)
    if members is not None:
        classes = [m for m in members if is_dataclass_type(m)]
        if len(classes) == 1 and all(m is type(None) or m is classes[0] for m in members):
            return classes[0]
    return None


def field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of a dataclass (and its dataclass bases): the string literal on the
    line(s) right after each field. Fields without one are absent."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):  # no source on disk (frozen or generated class)
            continue
        class_nodes = [n for n in ast.parse(source).body if isinstance(n, ast.ClassDef)]
        if not class_nodes:
            continue
        body = class_nodes[0].body
        for statement, following in zip(body, body[1:]):
            if (
                isinstance(statement, ast.AnnAssign)
                and isinstance(statement.target, ast.Name)
                and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
            ):
                docs[statement.target.id] = inspect.cleandoc(following.value.value)
    return docs


def leaf_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key under a dataclass: sections/nested dataclasses and their fields."""
    keys: list[str] = []
    for name, tp in field_types(cls).items():
        dotted = f"{prefix}{name}"
        keys.append(dotted)
        nested = nested_dataclass(tp)
        if nested is not None:
            keys.extend(leaf_keys(nested, dotted + "."))
    return keys


def type_name(tp: Any) -> str:
    """A short, readable name of a field type, used by the docs and in error messages."""
    if tp is type(None):
        return "null"
    if tp is Any:
        return "any"
    members = union_args(tp)
    if members is not None:
        named = [type_name(m) for m in members if m is not type(None)]
        text = " or ".join(named)
        return f"{text} or null" if type(None) in members else text
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(str(choice) for choice in typing.get_args(tp))
    if origin is not None:
        args = ", ".join("..." if a is Ellipsis else type_name(a) for a in typing.get_args(tp))
        return f"{origin.__name__}[{args}]" if args else origin.__name__
    return getattr(tp, "__name__", str(tp))


# ---------------------------------------------------------------- coercion


class FieldMismatch(Exception):
    """A value that does not fit a field's type: the dotted key, the value, the type and a hint
    (the recipe loader turns it into a ConfigError that also says where the value came from)."""

    def __init__(self, key: str, value: Any, tp: Any, hint: str = "") -> None:
        super().__init__(key)
        self.key, self.value, self.tp, self.hint = key, value, tp, hint


_TRUE_WORDS = frozenset({"true", "yes", "on", "1"})
_FALSE_WORDS = frozenset({"false", "no", "off", "0"})


def coerce(value: Any, tp: Any, key: str, raw: str | None) -> Any:
    """Convert a YAML value to a field's type, accepting the spellings users expect.

    `raw` is the command-line text of the value when there is one: a `str` field then takes the
    text itself, so `data.tokenizer=yes` means the string "yes" and not YAML's boolean.
    """
    if tp is Any or tp is object:
        return value
    if tp is type(None):
        if value is None:
            return None
        raise FieldMismatch(key, value, tp)

    members = union_args(tp)
    if members is not None:
        if value is None and type(None) in members:
            return None
        for member in members:
            if member is type(None):
                continue
            try:
                return coerce(value, member, key, raw)
            except FieldMismatch:
                continue
        raise FieldMismatch(key, value, tp)

    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        for choice in choices:
            if value == choice and type(value) is type(choice):
                return choice
        if raw is not None and raw.strip() in choices:
            return raw.strip()
        close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        raise FieldMismatch(key, value, tp, f"did you mean {close[0]}?" if close else "")

    if origin in (list, tuple, set, frozenset) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise FieldMismatch(key, value, tp, "write a list such as [1, 2]")
        args = typing.get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise FieldMismatch(key, value, tp, f"give exactly {len(args)} items")
            item_types = list(args)
        else:
            item_types = [args[0] if args else Any] * len(value)
        items = [coerce(v, t, f"{key}[{i}]", None) for i, (v, t) in enumerate(zip(value, item_types))]
        container = origin or tp
        return items if container is list else container(items)

    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise FieldMismatch(key, value, tp, "write a mapping such as {a: 1}")
        key_type, value_type = typing.get_args(tp) or (Any, Any)
        return {
            coerce(k, key_type, f"{key}.{k}", None): coerce(v, value_type, f"{key}.{k}", None) for k, v in value.items()
        }

    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.strip().lower() in _TRUE_WORDS | _FALSE_WORDS:
            return value.strip().lower() in _TRUE_WORDS
        raise FieldMismatch(key, value, tp, "use true or false")

    if tp is int:
        if isinstance(value, bool):
            raise FieldMismatch(key, value, tp)
        if isinstance(value, int):
            return value
        number = value
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                try:
                    number = float(value.strip())  # "1e3" is a string to YAML 1.1
                except ValueError:
                    raise FieldMismatch(key, value, tp) from None
        if isinstance(number, float) and math.isfinite(number) and number.is_integer():
            return int(number)
        raise FieldMismatch(key, value, tp)

    if tp is float:
        if isinstance(value, bool):
            raise FieldMismatch(key, value, tp)
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            # PyYAML follows YAML 1.1, where 3e-4 (no dot) is a string, not a float.
            try:
                return float(value.strip())
            except ValueError:
                raise FieldMismatch(key, value, tp) from None
        raise FieldMismatch(key, value, tp)

    if tp is str:
        if isinstance(value, str):
            return value
        if raw is not None:
            return raw.strip()
        raise FieldMismatch(key, value, tp, "quote it in YAML to make it a string")

    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise FieldMismatch(key, value, tp)


def plain(value: Any) -> Any:
    """Dataclasses, tuples and sets as YAML-safe builtins, keeping field order."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    return value
