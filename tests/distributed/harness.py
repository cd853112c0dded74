"""Start N gloo processes once and run several checks inside them.

Imports cost seconds per process on two cores, so a test launches one group of workers and
runs a list of checks in it. Every launch has a deadline: a hung collective fails the test
instead of stalling CI. Workers run with one intra-op thread (`OMP_NUM_THREADS=1`).

    results = run_workers(2, "tests.distributed.workers_tp:compare_one_step", payload, timeout_s=240)

The target is `module:function`; it is called as `function(parallel_env, payload)` in every
rank and its (picklable) return value is collected per rank.
"""

from __future__ import annotations

import datetime
import importlib
import os
import pathlib
import tempfile
import traceback
from dataclasses import dataclass
from typing import Any

import torch.multiprocessing as mp

CHECKOUT = pathlib.Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class WorkerEnv:
    rank: int
    world_size: int


def _worker(rank: int, world_size: int, store_path: str, target: str, payload: Any, queue) -> None:
    os.environ.update(
        OMP_NUM_THREADS="1", RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1"
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store_path}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=120),
        )
        module_name, function_name = target.split(":")
        function = getattr(importlib.import_module(module_name), function_name)
        queue.put((rank, "ok", function(WorkerEnv(rank, world_size), payload)))
    except BaseException:  # report everything, including assertion failures, to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_workers(world_size: int, target: str, payload: Any = None, timeout_s: float = 300) -> list[Any]:
    """Run `target` on `world_size` gloo ranks; return the per-rank results or raise with each
    failing rank's traceback. Kills every worker when the deadline passes."""
    context = mp.get_context("spawn")
    queue = context.Queue()
    with tempfile.TemporaryDirectory() as store_dir:
        store_path = os.path.join(store_dir, "store")
        processes = [
            context.Process(target=_worker, args=(rank, world_size, store_path, target, payload, queue), daemon=True)
            for rank in range(world_size)
        ]
        for process in processes:
            process.start()
        results: dict[int, tuple[str, Any]] = {}
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
        try:
            while len(results) < world_size:
                remaining = (deadline - datetime.datetime.now()).total_seconds()
                if remaining <= 0:
                    raise TimeoutError(
                        f"{target} on {world_size} ranks did not finish in {timeout_s:.0f} s "
                        f"(ranks done: {sorted(results)}); a collective probably hung"
                    )
                try:
                    rank, status, value = queue.get(timeout=min(remaining, 5.0))
                except Exception:
                    dead = [p for p in processes if not p.is_alive() and p.exitcode not in (0, None)]
                    if dead and len(results) < world_size and queue.empty():
                        raise RuntimeError(f"{target}: a worker died with exit code {dead[0].exitcode}") from None
                    continue
                results[rank] = (status, value)
        finally:
            for process in processes:
                process.join(timeout=10)
                if process.is_alive():
                    process.kill()
    failures = {rank: value for rank, (status, value) in results.items() if status == "error"}
    if failures:
        raise AssertionError("\n".join(f"--- rank {rank} ---\n{text}" for rank, text in sorted(failures.items())))
    return [results[rank][1] for rank in range(world_size)]
