"""Valid ranges of numeric config fields, declared as a table per section and checked at load.

A width, count or rank of 0 (or below) builds no model: the first forward would fail with a
shape error far from the field, or, worse, train with the value silently meaning something else
(-1 shared experts, a negative clipping threshold). Each section names its fields' kinds here;
`out_of_range` returns the one line for the first field outside its range. Torch-free.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["RANGES", "out_of_range"]

RANGES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "positive": (lambda v: v > 0, "must be positive"),
    "at_least_one": (lambda v: v >= 1, "must be at least 1"),
    "non_negative": (lambda v: v >= 0, "must not be negative"),
    "fraction": (lambda v: 0 <= v <= 1, "must lie in [0, 1]"),
    "open_fraction": (lambda v: 0 <= v < 1, "must lie in [0, 1)"),
}
"""kind → (test, what the message says). `*_or_null` kinds also accept null."""


def out_of_range(obj: Any, kinds: Mapping[str, str], prefix: str) -> str | None:
    """The message for the first field of `obj` (dotted names below it allowed) whose value is
    outside its kind's range, or None when all are inside."""
    for name, kind in kinds.items():
        value: Any = obj
        for part in name.split("."):
            value = getattr(value, part)
        nullable = kind.endswith("_or_null")
        base = kind.removesuffix("_or_null")
        if value is None and nullable:
            continue
        test, says = RANGES[base]
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not number or (isinstance(value, float) and not math.isfinite(value)) or not test(value):
            null = " (or null)" if nullable else ""
            return f"{prefix}{name} {says}{null}, got {value!r}"
    return None
