"""JSON from files a user hands in, with bounds: a size read before the file is, and a nesting
depth checked before anything walks the value.

`json.loads` of a 200,000-deep array raises RecursionError (not ValueError, so it escaped every
reader's `except`), and a value nested a few thousand deep parses but breaks whatever recursive
code meets it next. Each failure here is a `ValueError`, which every reader already turns into
its one line. Stdlib only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["MAX_DEPTH", "json_file", "json_text"]

MAX_DEPTH = 64
"""Deeper than any file k3train reads (a manifest is 3 deep, an HF config.json about 4, a
tokenizer.json about 6, a stored RNG state about 8)."""


def nesting_depth(value: Any, limit: int) -> int:
    """How deep lists and dicts nest in `value` (0 for a scalar), counting no further than
    `limit + 1`; iterative, so any depth is safe to measure."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        stack.extend((child, depth + 1) for child in children)
    return deepest


def json_text(text: str | bytes, max_depth: int = MAX_DEPTH) -> Any:
    """`json.loads(text)`, refusing (ValueError) a value nested deeper than `max_depth`."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError(f"JSON nested deeper than {max_depth} levels") from None
    if nesting_depth(value, max_depth) > max_depth:
        raise ValueError(f"JSON nested deeper than {max_depth} levels")
    return value


def json_file(path: str | Path, max_bytes: int, max_depth: int = MAX_DEPTH) -> Any:
    """The JSON in `path`, refusing (ValueError) a file over `max_bytes` before reading it, and
    a value nested deeper than `max_depth`. OSError and UnicodeDecodeError pass through."""
    path = Path(path)
    size = path.stat().st_size
    if size > max_bytes:
        raise ValueError(f"{size:,} bytes, more than the {max_bytes:,} a {path.name} may have")
    return json_text(path.read_bytes().decode("utf-8"), max_depth)
