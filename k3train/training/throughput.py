"""Throughput, MFU and memory: what the step line reports besides the loss.

MFU = achieved training FLOP/s (active FLOPs per token from `k3train.model.flops` × tokens/s)
over the device's peak. GPUs take their dense bf16 peak from a table; on a CPU there is no
meaningful datasheet number, so the peak is a dense fp32 matmul rate measured at start-up, and
the line says so ("MFU(cpu-matmul)").
"""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import dataclass

import torch

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


@dataclass(frozen=True)
class PeakFlops:
    tflops: float
    label: str  # "MFU" against a datasheet peak, "MFU(cpu-matmul)" against a measured rate


def measure_cpu_matmul_tflops(size: int = 1024, seconds: float = 0.2, trials: int = 3) -> float:
    """Dense fp32 matmul rate of this process's threads, in TFLOP/s: the best of a few short
    trials, since a shared machine only ever slows a trial down."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b  # warm-up
    best = 0.0
    for _ in range(trials):
        iterations, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            a @ b
            iterations += 1
        best = max(best, 2 * size**3 * iterations / (time.perf_counter() - start) / 1e12)
    return best


def peak_flops(device: torch.device, override_tflops: float | None = None) -> PeakFlops:
    if override_tflops is not None:
        return PeakFlops(override_tflops, "MFU")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tflops in GPU_PEAK_BF16_TFLOPS:
            if key in name:
                return PeakFlops(tflops, "MFU")
        print(f"note: no peak-FLOPs entry for {name!r}; set logging.peak_tflops for MFU", file=sys.stderr)
    return PeakFlops(measure_cpu_matmul_tflops(), "MFU(cpu-matmul)")


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
