"""Rates measured once per machine and kept in k3train's cache (k3train/cache.py): the CPU
matmul peak that MFU divides by (k3train/training/throughput.py) and the call size from which
bf16 matmuls beat fp32 on this CPU (k3train/optim/bf16_probe.py, which decides where
Newton–Schulz runs in bf16).

Each entry is keyed by the CPU model, the thread count and the torch version (its matmul
kernels) and written atomically, so ranks starting together never read half a file; an
unreadable or unwritable cache only means measuring again.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import platform
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from k3train.cache import cache_dir

__all__ = ["cached_measurement", "cpu_model_name", "machine_key"]


def cpu_model_name() -> str:
    """The CPU's model name (`/proc/cpuinfo` on Linux, else `platform.processor()`)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"


def machine_key(threads: int) -> str:
    """The cache key of a measured rate: CPU model, thread count and torch version."""
    # "cpu-time": rates measured over the process's CPU time (entries of the earlier wall-clock
    # measurement, depressed by load, are not reused).
    return f"{cpu_model_name()} | {threads} thread(s) | torch {torch.__version__} | cpu-time"


def cached_measurement(
    file_name: str, key: str, field: str, measure: Callable[[], Any], directory: Path | None = None
) -> tuple[Any, str]:
    """`entries[key][field]` of the cache file `file_name`, or `measure()` written there; with a
    phrase saying where the value came from ("measured <when>, cached in <path>" or "measured now,
    ...")."""
    path = (directory or cache_dir()) / file_name
    with _exclusive(path.with_suffix(".lock")):  # ranks starting together: one measures, the rest read
        return _read_or_measure(path, key, field, measure)


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """An advisory lock on `lock_path` (held while measuring: measurements on a shared machine
    disturb each other); without a writable cache, no lock."""
    try:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(lock_path, "a")
    except OSError:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _read_or_measure(path: Path, key: str, field: str, measure: Callable[[], Any]) -> tuple[Any, str]:
    entries: dict[str, Any] = {}
    try:
        entries = json.loads(path.read_text())
        entry = entries[key]
        return entry[field], f"measured {entry['measured']}, cached in {path}"
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError):
        entries = entries if isinstance(entries, dict) else {}
    value = measure()
    entries[key] = {field: value, "measured": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps(entries, indent=1, sort_keys=True) + "\n")
        os.replace(temporary, path)  # atomic: ranks starting together never read half a file
        where = f"cached in {path}"
    except OSError as error:
        where = f"not cached ({path}: {error.strerror or error})"
    return value, f"measured now, {where}"
