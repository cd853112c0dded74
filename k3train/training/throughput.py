"""Throughput, MFU and memory: what the step line reports besides the loss.

MFU = achieved training FLOP/s (active FLOPs per token from `k3train.model.flops` × tokens/s)
over the device's peak. GPUs take their dense bf16 peak from a table; on a CPU there is no
meaningful datasheet number, so the peak is a dense fp32 matmul rate measured on this machine
with this process's thread count, and the line says so ("MFU(cpu-matmul)"). The measurement is
the median of several trials of half a second, each timed by the process's CPU time over its
threads where that is shorter than the wall clock (so load from other processes does not depress
it), and is cached per machine
(`cpu_matmul_peak.json` in k3train's cache, `$K3TRAIN_CACHE_DIR` or `~/.cache/k3train`: see
k3train/cache.py; keyed by CPU model, thread count and torch version), so
a run that starts while the machine is busy reuses the rate measured earlier instead of a
depressed one. `logging.peak_tflops` pins the peak instead. Newton–Schulz FLOPs are optimizer
FLOPs: reported beside MFU (`muon_step_stats`), never counted in it.
"""

from __future__ import annotations

import resource
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from k3train.machine_rates import cached_measurement, machine_key

# Dense (non-sparse) bf16 tensor-core peaks in TFLOP/s, by a substring of the device name.
GPU_PEAK_BF16_TFLOPS = (
    ("B200", 2250.0),
    ("H200", 989.0),
    ("H100", 989.0),
    ("H800", 989.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("A10", 125.0),
)

CPU_PEAK_CACHE_FILE = "cpu_matmul_peak.json"


@dataclass(frozen=True)
class PeakFlops:
    tflops: float
    label: str  # "MFU" against a datasheet or pinned peak, "MFU(cpu-matmul)" against a measured rate
    source: str = ""
    """Where the peak comes from, for the start-up line (`describe`)."""

    def describe(self) -> str:
        return f"MFU peak: {self.tflops:.4g} TFLOP/s per device ({self.source or self.label})"


def measure_cpu_matmul_tflops(size: int = 1024, seconds: float = 0.5, trials: int = 7) -> float:
    """Dense fp32 `size`² matmul rate of this process's threads, in TFLOP/s: the median of
    `trials` trials of at least `seconds` each (a median, not the best: one lucky trial on a
    turbo-boosting core would overstate the peak as much as a busy one understates it)."""
    return statistics.median(_matmul_trials(size, seconds, trials))


def _matmul_trials(size: int, seconds: float, trials: int) -> list[float]:
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b  # warm-up
    threads = torch.get_num_threads()
    rates = []
    for _ in range(trials):
        iterations, start, cpu_start = 0, time.perf_counter(), time.process_time()
        while time.perf_counter() - start < seconds:
            a @ b
            iterations += 1
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        # On a busy machine the wall clock counts time other processes held the cores; the
        # process's CPU time over its threads does not, so the shorter of the two is the rate
        # these cores reach (an idle machine gives the same number either way).
        elapsed = min(wall, cpu / threads) if cpu > 0 else wall
        rates.append(2 * size**3 * iterations / elapsed / 1e12)
    return rates


def cpu_peak_key(threads: int) -> str:
    """The cache key of a CPU peak (`machine_key`: CPU model, thread count, torch version)."""
    return machine_key(threads)


def cached_cpu_peak(
    threads: int | None = None, directory: Path | None = None, measure: Callable[[], float] = measure_cpu_matmul_tflops
) -> tuple[float, str]:
    """The CPU matmul peak for `threads` (default: torch's current count) and where it came from:
    the cached rate of this machine if there is one, else `measure()` (written to the cache)."""
    threads = threads or torch.get_num_threads()
    tflops, where = cached_measurement(CPU_PEAK_CACHE_FILE, cpu_peak_key(threads), "tflops", measure, directory)
    if where.startswith("measured now"):
        return (
            float(tflops),
            f"fp32 matmul rate {where.replace('measured now', f'measured now with {threads} thread(s), median of trials')}",
        )
    return float(tflops), f"fp32 matmul rate {where}"


def peak_flops(device: torch.device, override_tflops: float | None = None) -> PeakFlops:
    if override_tflops is not None:
        return PeakFlops(override_tflops, "MFU", "logging.peak_tflops")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tflops in GPU_PEAK_BF16_TFLOPS:
            if key in name:
                return PeakFlops(tflops, "MFU", f"dense bf16 datasheet peak of {key}")
        print(f"note: no peak-FLOPs entry for {name!r}; set logging.peak_tflops for MFU", file=sys.stderr)
    tflops, source = cached_cpu_peak()
    return PeakFlops(tflops, "MFU(cpu-matmul)", source)


def muon_step_stats(optimizer: Any) -> Any | None:
    """The Newton–Schulz statistics of the last optimizer step (`PerHeadMuon.step_stats`: seconds
    and FLOPs on this rank), through the data-parallel wrapper; None for an optimizer without
    Muon (plain AdamW)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    return getattr(inner, "step_stats", None)


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this rank: CUDA allocator peak, or the process's peak resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30  # Linux reports KiB


def rank_memory_gib(device: torch.device, world_size: int) -> list[float]:
    """Every rank's peak memory (one small all-gather when there are several ranks)."""
    own = peak_memory_gib(device)
    if world_size == 1 or not torch.distributed.is_initialized():
        return [own]
    gathered = [torch.zeros(1, dtype=torch.float64, device=device) for _ in range(world_size)]
    torch.distributed.all_gather(gathered, torch.tensor([own], dtype=torch.float64, device=device))
    return [value.item() for value in gathered]


def format_eta(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
