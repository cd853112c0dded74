"""How many intra-op CPU threads each rank uses, chosen without torch (so it is testable alone).

torch's default is every core of the machine in every process: with several ranks per machine,
or a machine shared with other jobs, the threads oversubscribe the cores and a step can take ten
times longer. Unless told otherwise the job divides the cores it may run on among its local ranks.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Optional

__all__ = ["available_cores", "choose_num_threads", "machine_busy_fraction"]


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity, which containers and `taskset`
    narrow), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not every platform has sched_getaffinity
        return os.cpu_count() or 1


def _positive_int(text: Optional[str]) -> Optional[int]:
    try:
        value = int(text) if text is not None else None
    except ValueError:
        return None
    return value if value is not None and value >= 1 else None


def machine_busy_fraction() -> float:
    """How busy the machine was over the last minute: the load average over its cores, 0 to 1
    (0 where the platform has no load average)."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0
    return min(max(load / (os.cpu_count() or 1), 0.0), 1.0)


def choose_num_threads(configured: Optional[int], environ: Mapping[str, str], cores: int,
                       busy_fraction: float = 0.0) -> tuple[int, str]:
    """Intra-op threads per rank and the one line that says where the number came from.

    In order: `train.num_threads` when positive; else `OMP_NUM_THREADS` when it is a positive
    integer (torch reads it too); else the cores that are free (`cores` less the share
    `busy_fraction` other work keeps busy) divided among the local ranks (`LOCAL_WORLD_SIZE`, set
    by torchrun; 1 without it), at least 1. Counting only free cores matters: OpenMP threads
    spin while they wait for each other, and on a loaded machine two threads per rank made the
    debug run several times slower than one.
    """
    if configured:
        return configured, f"threads: {configured} per rank (train.num_threads)"
    from_environment = _positive_int(environ.get("OMP_NUM_THREADS"))
    if from_environment is not None:
        return from_environment, f"threads: {from_environment} per rank (OMP_NUM_THREADS)"
    local_ranks = _positive_int(environ.get("LOCAL_WORLD_SIZE")) or 1
    cores = max(cores, 1)
    busy_fraction = min(max(busy_fraction, 0.0), 1.0)
    free_cores = max(int(cores * (1.0 - busy_fraction)), 1)
    threads = max(free_cores // local_ranks, 1)
    busy = f", {busy_fraction:.0%} busy → {free_cores} free" if busy_fraction > 0 else ""
    return threads, (f"threads: {threads} per rank ({cores} cores{busy} / {local_ranks} local "
                     f"rank{'s' if local_ranks != 1 else ''}; set OMP_NUM_THREADS or train.num_threads to override)")
