"""Newton–Schulz time per rank: one process against DP2 (gloo, one thread per rank), the 512-wide K3-shaped model.

The job's optimizer (`build_rank`) steps on fixed random gradients (no forward or backward: only
the optimizer is timed), and each rank reports `PerHeadMuon.step_stats` (its Newton–Schulz
seconds and FLOPs, and the exchange of the split). Rows: one process; DP2 without ZeRO-1 and
without the split (every rank orthogonalises everything); DP2 without ZeRO-1 with the split
(`optimizer.muon_split_over_dp=true`, the default); DP2 with ZeRO-1 (owners step their own).

    OMP_NUM_THREADS=1 nice python benchmarks/newton_schulz_dp.py            # ~1-2 min on two cores
"""

from __future__ import annotations

import datetime
import os
import statistics
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from k3train.benchmarking.step_comparison import DEBUG_RECIPE, WIDE_MODEL
from k3train.config import load_config
from k3train.optim.muon import PerHeadMuon
from k3train.parallel.state import Layout, ParallelState
from k3train.training.build import build_rank

ROOT = Path(__file__).resolve().parents[1]
STEPS = 4  # per case; the first is a warm-up


def optimizer_times(cases: dict[str, list[str]], parallel: ParallelState) -> dict[str, dict[str, float]]:
    """Each case's median Newton–Schulz and exchange seconds and its NS GFLOP on this rank; the
    cases' steps alternate, so a machine that gets busier slows them alike."""
    jobs = {
        label: build_rank(load_config(str(DEBUG_RECIPE), [*WIDE_MODEL, *overrides]), parallel, torch.device("cpu"))
        for label, overrides in cases.items()
    }
    samples: dict[str, list[tuple[float, float, int]]] = {label: [] for label in cases}
    for step in range(STEPS):
        for label, job in jobs.items():
            generator = torch.Generator().manual_seed(step)
            for param in job.model.parameters():  # the same gradients on every rank, as after the all-reduce
                param.grad = torch.randn(param.shape, generator=generator) * 1e-2
            job.optimizer.step()
            muon = job.optimizer.optimizer
            assert isinstance(muon, PerHeadMuon), "the debug recipe's optimizer is Muon"
            stats = muon.step_stats
            if step:
                samples[label].append((stats.ns_seconds, stats.exchange_seconds, stats.ns_flops))
    return {
        label: {
            "ns_s": statistics.median(s for s, _, _ in rows),
            "exchange_s": statistics.median(e for _, e, _ in rows),
            "gflop": rows[-1][2] / 1e9,
        }
        for label, rows in samples.items()
    }


def _rank(rank: int, store: str, cases: dict[str, list[str]], queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=300)
    )
    try:
        parallel = ParallelState(Layout(2, tp=1, pp=1, dp=2, ep=1), rank)
        queue.put((rank, optimizer_times(cases, parallel)))
    finally:
        dist.destroy_process_group()


def main() -> None:
    torch.set_num_threads(1)
    single = optimizer_times({"one": ["parallel.zero1=false"]}, ParallelState.single())["one"]
    cases = {
        "DP2, no ZeRO-1, no split": ["parallel.dp=2", "parallel.zero1=false", "optimizer.muon_split_over_dp=false"],
        "DP2, no ZeRO-1, split": ["parallel.dp=2", "parallel.zero1=false"],
        "DP2, ZeRO-1": ["parallel.dp=2", "parallel.zero1=true"],
    }
    context = mp.get_context("spawn")
    queue = context.Queue()
    with tempfile.TemporaryDirectory() as directory:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        processes = [
            context.Process(target=_rank, args=(rank, os.path.join(directory, "store"), cases, queue))
            for rank in range(2)
        ]
        for process in processes:
            process.start()
        results = dict(queue.get(timeout=900) for _ in processes)
        for process in processes:
            process.join(timeout=30)
    unsplit = "DP2, no ZeRO-1, no split"
    print("\n| run | rank | Newton–Schulz GFLOP | Newton–Schulz s | vs one process | vs DP2 unsplit | exchange s |")
    print("|---|---|---|---|---|---|---|")
    print(f"| one process | 0 | {single['gflop']:.1f} | {single['ns_s']:.3f} | 1.00 | - | - |")
    for label in cases:
        for rank in range(2):
            row = results[rank][label]
            print(
                f"| {label} | {rank} | {row['gflop']:.1f} | {row['ns_s']:.3f} | {row['ns_s'] / single['ns_s']:.2f} "
                f"| {row['ns_s'] / results[rank][unsplit]['ns_s']:.2f} | {row['exchange_s']:.3f} |"
            )


if __name__ == "__main__":
    main()
