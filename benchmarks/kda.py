"""Time the chunkwise KDA kernel against the token-by-token reference on CPU.

Both kernels run side by side in one process: every repeat times each of them once, in
alternation, so slow drifts of a shared machine hit both alike; the table reports medians.

    OMP_NUM_THREADS=1 python benchmarks/kda.py --threads 1 --repeats 5 --chunk-sizes 16 64
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from k3train.kernels.kda import chunk_kda, naive_recurrent_kda  # noqa: E402


def make_inputs(
    seq_len: int, heads: int, head_dim: int, requires_grad: bool, seed: int = 0
) -> dict[str, torch.Tensor]:
    """fp32 inputs `B=1` with K3's bounded gate range (g in (−5, 0)) and normalised q, k."""
    generator = torch.Generator().manual_seed(seed)
    shape = (1, seq_len, heads, head_dim)
    tensors = {
        "q": F.normalize(torch.randn(shape, generator=generator), dim=-1),
        "k": F.normalize(torch.randn(shape, generator=generator), dim=-1),
        "v": torch.randn(shape, generator=generator),
        "g": -5.0 * torch.sigmoid(torch.randn(shape, generator=generator)),
        "beta": torch.sigmoid(torch.randn(shape[:3], generator=generator)),
    }
    for tensor in tensors.values():
        tensor.requires_grad_(requires_grad)
    return tensors


def time_once(kernel: Callable, inputs: dict[str, torch.Tensor], backward: bool) -> float:
    """Seconds for one forward (under no_grad) or one forward + backward."""
    start = time.perf_counter()
    if backward:
        o, _ = kernel(**inputs)
        o.sum().backward()
    else:
        with torch.no_grad():
            kernel(**inputs)
    elapsed = time.perf_counter() - start
    for tensor in inputs.values():
        tensor.grad = None  # fresh gradients each run, so no run pays for accumulation
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per kernel and case")
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64, help="K = V")
    parser.add_argument(
        "--chunk-sizes", type=int, nargs="+", default=[16, 64], help="one column per chunk size"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    kernels: dict[str, Callable] = {"recurrent": naive_recurrent_kda}
    for chunk_size in args.chunk_sizes:
        kernels[f"chunked C={chunk_size}"] = functools.partial(
            chunk_kda, chunk_size=chunk_size, backend="torch"
        )
    print(
        f"torch {torch.__version__}, {args.threads} thread(s), B=1 H={args.heads} "
        f"K=V={args.head_dim}, fp32, g in (-5, 0), median of {args.repeats}\n"
    )
    chunked_names = list(kernels)[1:]
    header = ["T", "pass", "recurrent (ms)"]
    for name in chunked_names:
        header += [f"{name} (ms)", "speed-up"]
    print("| " + " | ".join(header) + " |")
    print("| " + " | ".join(["---:", "---"] + ["---:"] * (len(header) - 2)) + " |")
    for seq_len in args.lengths:
        for backward in (False, True):
            inputs = make_inputs(seq_len, args.heads, args.head_dim, requires_grad=backward)
            times: dict[str, list[float]] = {name: [] for name in kernels}
            for kernel in kernels.values():  # warm-up, not timed
                time_once(kernel, inputs, backward)
            for _ in range(args.repeats):
                for name, kernel in kernels.items():  # interleaved: drifts hit all alike
                    times[name].append(time_once(kernel, inputs, backward))
            medians = {name: 1e3 * statistics.median(runs) for name, runs in times.items()}
            row = [str(seq_len), "fwd+bwd" if backward else "fwd", f"{medians['recurrent']:.1f}"]
            for name in chunked_names:
                row += [f"{medians[name]:.1f}", f"{medians['recurrent'] / medians[name]:.1f}x"]
            print("| " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
