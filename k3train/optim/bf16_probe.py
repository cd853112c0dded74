"""Where bf16 Newton–Schulz is faster than fp32 on this CPU, measured rather than guessed.

Whether a CPU multiplies bf16 faster than fp32 is not one feature flag: with AMX tiles oneDNN's
bf16 matmuls are several times faster, AVX512_BF16 alone (AMD Zen 4) gives about twice the
rate, and older CPUs convert and run slower; every bf16 call also pays fixed costs (the casts,
oneDNN's set-up) that small calls do not earn back. So the probe times the real iteration
(`newton_schulz`, five steps, its casts included) in both dtypes at a ladder of call sizes with
this process's thread count, and the crossover is the smallest call (in Newton–Schulz FLOPs)
from which bf16 is at least `REQUIRED_SPEEDUP` faster at that size and at every larger one.

It takes about a second and is cached per machine (k3train/machine_rates.py: CPU model, thread
count, torch version), as the MFU peak is. Each trial is timed by the process's CPU time where
that is shorter than the wall clock, so load from other processes depresses both dtypes alike.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Sequence

import torch

from k3train.machine_rates import cached_measurement, machine_key
from k3train.optim.newton_schulz import NS_COEFFICIENTS, NS_EPS, NS_STEPS, newton_schulz, ns_flops

__all__ = ["PROBE_SHAPES", "REQUIRED_SPEEDUP", "bf16_crossover_flops", "cpu_bf16_min_flops", "measure_bf16_speedups"]

PROBE_SHAPES: tuple[tuple[int, int, int], ...] = (
    (16, 64, 64),
    (8, 128, 128),
    (16, 128, 256),
    (4, 256, 256),
    (2, 512, 512),
)
"""`(blocks, rows, cols)` of the timed calls: per-head blocks of small models up to whole
matrices (about 0.1 to 7 GFLOP per call)."""
REQUIRED_SPEEDUP = 1.1
"""bf16 must be this much faster to be chosen: a tie is not worth bf16's rounding."""
BF16_PROBE_CACHE_FILE = "cpu_bf16_newton_schulz.json"


def _seconds_per_call(blocks: torch.Tensor, dtype: torch.dtype, min_seconds: float, trials: int) -> float:
    threads = torch.get_num_threads()
    newton_schulz(blocks, NS_STEPS, NS_COEFFICIENTS, NS_EPS, compute_dtype=dtype)  # warm-up
    times = []
    for _ in range(trials):
        calls, start, cpu_start = 0, time.perf_counter(), time.process_time()
        while time.perf_counter() - start < min_seconds or calls == 0:
            newton_schulz(blocks, NS_STEPS, NS_COEFFICIENTS, NS_EPS, compute_dtype=dtype)
            calls += 1
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        times.append((min(wall, cpu / threads) if cpu > 0 else wall) / calls)
    return statistics.median(times)


def measure_bf16_speedups(
    shapes: Sequence[tuple[int, int, int]] = PROBE_SHAPES, min_seconds: float = 0.03, trials: int = 3
) -> list[list[float]]:
    """`[blocks, rows, cols, fp32 time / bf16 time]` per shape, fp32 input as Muon gives it."""
    generator = torch.Generator().manual_seed(0)
    rows_out = []
    for blocks, rows, cols in shapes:
        x = torch.randn(blocks, rows, cols, generator=generator)
        fp32 = _seconds_per_call(x, torch.float32, min_seconds, trials)
        bf16 = _seconds_per_call(x, torch.bfloat16, min_seconds, trials)
        rows_out.append([blocks, rows, cols, fp32 / bf16])
    return rows_out


def bf16_crossover_flops(speedups: Sequence[Sequence[float]], required: float = REQUIRED_SPEEDUP) -> float:
    """The smallest call size (NS FLOPs) from which every measured call as large or larger was
    `required` times faster in bf16; `math.inf` when the largest was not."""
    by_size = sorted((int(b) * ns_flops(int(r), int(c)), float(s)) for b, r, c, s in speedups)
    crossover = math.inf
    for flops, speedup in reversed(by_size):
        if speedup < required:
            break
        crossover = flops
    return crossover


@functools.cache
def cpu_bf16_min_flops(threads: int | None = None) -> float:
    """The crossover for this machine and `threads` (default: torch's current count), from the
    cache or measured now. Cached in the process too: the decision is taken once per run."""
    threads = threads or torch.get_num_threads()
    speedups, _ = cached_measurement(BF16_PROBE_CACHE_FILE, machine_key(threads), "speedups", measure_bf16_speedups)
    return bf16_crossover_flops(speedups)
