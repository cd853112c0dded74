"""How many intra-op CPU threads each rank uses, chosen without torch (so it is testable alone).

torch's default is every core of the machine in every process: with several ranks per machine,
or a machine shared with other jobs, the threads oversubscribe the cores and a step can take ten
times longer. Unless told otherwise the job divides the cores it may run on among its local ranks.

torchrun sets `OMP_NUM_THREADS=1` for its ranks when it was unset and there is more than one
rank per machine (torch/distributed/run.py, with a warning), so a rank sees the same "1" whether
the user asked for it or not. The trace is the agent's own environment: torchrun sets the
variable in its Python `os.environ`, which its ranks inherit, but a process's start-up
environment (`/proc/<pid>/environ` on Linux) keeps what it was launched with. A rank whose
parent agent was started without `OMP_NUM_THREADS` got torchrun's default, not the user's.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping

__all__ = ["available_cores", "choose_num_threads", "launcher_environment", "machine_busy_fraction"]

TORCHRUN_DEFAULT_OMP = "1"
"""What torchrun puts in OMP_NUM_THREADS when the user left it unset (nproc_per_node > 1)."""


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity, which containers and `taskset`
    narrow), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not every platform has sched_getaffinity
        return os.cpu_count() or 1


def _positive_int(text: str | None) -> int | None:
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


def launcher_environment(environ: Mapping[str, str], parent_pid: int | None = None) -> frozenset[str] | None:
    """The names of the variables torchrun's agent was started with, when this process is one of
    its ranks (`TORCHELASTIC_RUN_ID` set) and the agent's start-up environment is readable
    (`/proc/<parent>/environ`, Linux); None otherwise."""
    if "TORCHELASTIC_RUN_ID" not in environ:
        return None
    try:
        with open(f"/proc/{parent_pid or os.getppid()}/environ", "rb") as stream:
            entries = stream.read().split(b"\0")
    except OSError:
        return None
    return frozenset(entry.split(b"=", 1)[0].decode(errors="replace") for entry in entries if entry)


def choose_num_threads(
    configured: int | None,
    environ: Mapping[str, str],
    cores: int,
    busy_fraction: float = 0.0,
    launcher_variables: Collection[str] | None = None,
) -> tuple[int, str]:
    """Intra-op threads per rank and the one line that says why.

    In order: `train.num_threads` when positive; else `OMP_NUM_THREADS` when it is a positive
    integer the user set (torch reads it too); else the cores that are free (`cores` less the
    share `busy_fraction` other work keeps busy) divided among the local ranks
    (`LOCAL_WORLD_SIZE`, set by torchrun; 1 without it), at least 1. Counting only free cores
    matters: OpenMP threads spin while they wait for each other, and on a loaded machine two
    threads per rank made the debug run several times slower than one.

    `launcher_variables` are the names torchrun's agent was started with (`launcher_environment`):
    an `OMP_NUM_THREADS=1` they lack is torchrun's default and does not count as the user's. When
    they are unknown under torchrun the 1 is kept (it may be the user's) and the line says so.
    """
    if configured:
        return configured, f"threads: {configured} per rank (train.num_threads)"
    local_ranks = _positive_int(environ.get("LOCAL_WORLD_SIZE")) or 1
    omp = environ.get("OMP_NUM_THREADS")
    from_environment = _positive_int(omp)
    torchrun_may_have_set_it = omp == TORCHRUN_DEFAULT_OMP and local_ranks > 1 and "TORCHELASTIC_RUN_ID" in environ
    torchrun_default = (
        torchrun_may_have_set_it and launcher_variables is not None and "OMP_NUM_THREADS" not in launcher_variables
    )
    if from_environment is not None and not torchrun_default:
        if torchrun_may_have_set_it and launcher_variables is None:  # origin unknown: keep it, say how to choose
            return 1, (
                "threads: 1 per rank (OMP_NUM_THREADS=1, which torchrun also sets when it is unset: "
                "set train.num_threads to choose)"
            )
        return from_environment, f"threads: {from_environment} per rank (OMP_NUM_THREADS={omp})"
    cores = max(cores, 1)
    busy_fraction = min(max(busy_fraction, 0.0), 1.0)
    free_cores = max(int(cores * (1.0 - busy_fraction)), 1)
    threads = max(free_cores // local_ranks, 1)
    busy = f", {busy_fraction:.0%} busy → {free_cores} free" if busy_fraction > 0 else ""
    ignored = "; torchrun's default OMP_NUM_THREADS=1 not used" if torchrun_default else ""
    return threads, (
        f"threads: {threads} per rank ({cores} cores{busy} / {local_ranks} local "
        f"rank{'s' if local_ranks != 1 else ''}{ignored}; "
        f"set OMP_NUM_THREADS or train.num_threads to override)"
    )
