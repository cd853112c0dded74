"""Time the chunkwise KDA kernel against the token-by-token reference on CPU.

Both kernels run side by side in one process: every repeat times each of them once, in
alternation, so slow drifts of a shared machine hit both alike; the table reports medians.
With `--rate`, each chunked kernel's column also gives its FLOP rate (the forward FLOPs of
`k3train.model.flops.kda_chunk_flops_per_chunk`, times 3 for forward + backward) as a share of a
dense 1024×1024 fp32 matmul timed in the same alternation. `--before FILE` adds another
version of `kernels/kda/chunk.py` (e.g. `git show REV:kernels/kda/chunk.py > /tmp/old_chunk.py`)
as its own column, timed in the same alternation.

    OMP_NUM_THREADS=1 python benchmarks/kda.py --threads 1 --repeats 5 --chunk-sizes 16 64
    OMP_NUM_THREADS=1 nice python benchmarks/kda.py --no-recurrent --rate --chunk-sizes 64 \
        --lengths 512 4096 --head-dim 64 --before /tmp/old_chunk.py

With `--before-siblings`, the old `chunk.py` imports old versions of its sibling modules too
(`git show REV:kernels/kda/tiles.py > /tmp/old_tiles.py`, likewise `chunk_training.py`, then
`--before /tmp/old_chunk.py --before-siblings /tmp/old_tiles.py /tmp/old_chunk_training.py`).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

from k3train.kernels.kda import chunk_kda, naive_recurrent_kda
from k3train.model.flops import kda_chunk_flops_per_chunk


def load_chunk_module(path: str, siblings: Sequence[str] = ()):
    """Another version of `kernels/kda/chunk.py`, imported inside the `kda` package so its
    relative imports resolve. `siblings`: other versions of the modules it imports (e.g.
    `tiles.py`, then `chunk_training.py`), which its relative imports then bind to instead of the
    checkout's (each stands in under its module name only while the next ones load)."""
    import importlib.util

    def load(name: str, file: str):
        spec = importlib.util.spec_from_file_location(name, file)
        assert spec is not None and spec.loader is not None, f"{file} is a .py file, which always has a loader"
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    replaced: dict[str, ModuleType | None] = {}
    try:
        for file in siblings:
            name = f"k3train.kernels.kda.{Path(file).stem}"
            replaced.setdefault(name, sys.modules.get(name))
            sys.modules[name] = load(name, file)
        return load("k3train.kernels.kda._chunk_before", path)
    finally:
        for name, module in replaced.items():
            # None is a valid sys.modules value (it blocks the import); typeshed's type omits it.
            sys.modules[name] = module  # type: ignore[assignment]


def time_matmul(clock: Callable[[], float], size: int = 1024) -> float:
    a, b = torch.randn(size, size), torch.randn(size, size)
    start = clock()
    a @ b
    return clock() - start


def make_inputs(
    seq_len: int,
    heads: int,
    head_dim: int,
    requires_grad: bool,
    seed: int = 0,
    batch: int = 1,
    gate_scale: float = 5.0,
) -> dict[str, torch.Tensor]:
    """fp32 inputs with normalised q, k and g in (−gate_scale, 0) (5: K3's bounded gate range)."""
    generator = torch.Generator().manual_seed(seed)
    shape = (batch, seq_len, heads, head_dim)
    tensors = {
        "q": F.normalize(torch.randn(shape, generator=generator), dim=-1),
        "k": F.normalize(torch.randn(shape, generator=generator), dim=-1),
        "v": torch.randn(shape, generator=generator),
        "g": -gate_scale * torch.sigmoid(torch.randn(shape, generator=generator)),
        "beta": torch.sigmoid(torch.randn(shape[:3], generator=generator)),
    }
    for tensor in tensors.values():
        tensor.requires_grad_(requires_grad)
    return tensors


def time_once(
    kernel: Callable, inputs: dict[str, torch.Tensor], backward: bool, clock: Callable[[], float] = time.perf_counter
) -> float:
    """Seconds for one forward (under no_grad) or one forward + backward."""
    start = clock()
    if backward:
        o, _ = kernel(**inputs)
        o.sum().backward()
    else:
        with torch.no_grad():
            kernel(**inputs)
    elapsed = clock() - start
    for tensor in inputs.values():
        tensor.grad = None  # fresh gradients each run, so no run pays for accumulation
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per kernel and case")
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64, help="K = V")
    parser.add_argument("--chunk-sizes", type=int, nargs="+", default=[16, 64], help="one column per chunk size")
    parser.add_argument("--no-recurrent", action="store_true", help="leave out the (slow) recurrence")
    parser.add_argument("--rate", action="store_true", help="FLOP rate as a share of a dense matmul")
    parser.add_argument("--before", help="another chunk.py to time alongside (a column per chunk size)")
    parser.add_argument(
        "--before-siblings",
        nargs="+",
        default=[],
        metavar="FILE",
        help="other versions of the modules --before imports, in import order "
        "(e.g. its tiles.py, then chunk_training.py); default: the checkout's",
    )
    parser.add_argument(
        "--gate-scale",
        type=float,
        default=5.0,
        help="g in (-gate-scale, 0): 5 gives 16-token tiles at C=64, 1.2 one tile per chunk",
    )
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time this process's CPU seconds (robust to a loaded machine), not wall-clock",
    )
    args = parser.parse_args()
    clock = time.process_time if args.cpu_time else time.perf_counter
    torch.set_num_threads(args.threads)

    kernels: dict[str, Callable] = {} if args.no_recurrent else {"recurrent": naive_recurrent_kda}
    before = load_chunk_module(args.before, args.before_siblings) if args.before else None
    for chunk_size in args.chunk_sizes:
        if before is not None:
            kernels[f"before C={chunk_size}"] = functools.partial(
                before.chunk_kda, chunk_size=chunk_size, backend="torch"
            )
        kernels[f"chunked C={chunk_size}"] = functools.partial(chunk_kda, chunk_size=chunk_size, backend="torch")
    print(
        f"torch {torch.__version__}, {args.threads} thread(s), B={args.batch} H={args.heads} "
        f"K=V={args.head_dim}, fp32, g in (-{args.gate_scale:g}, 0), median of {args.repeats} "
        f"({'process CPU' if args.cpu_time else 'wall-clock'} time)\n"
    )
    chunked_names = [name for name in kernels if name != "recurrent"]
    header = ["T", "pass"] + ([] if args.no_recurrent else ["recurrent (ms)"])
    for name in chunked_names:
        header += [f"{name} (ms)"] + ([] if args.no_recurrent else ["speed-up"])
        header += ["GFLOP/s", "/ matmul"] if args.rate else []
    if args.rate:
        header += ["matmul GFLOP/s"]
    print("| " + " | ".join(header) + " |")
    print("| " + " | ".join(["---:", "---"] + ["---:"] * (len(header) - 2)) + " |")
    for seq_len in args.lengths:
        for backward in (False, True):
            inputs = make_inputs(
                seq_len, args.heads, args.head_dim, requires_grad=backward, batch=args.batch, gate_scale=args.gate_scale
            )
            times: dict[str, list[float]] = {name: [] for name in kernels}
            matmul_times: list[float] = []
            for kernel in kernels.values():  # warm-up, not timed
                time_once(kernel, inputs, backward, clock)
            for repeat in range(args.repeats):
                # Interleaved, so drifts hit all alike; in reversed order every other repeat, so no
                # kernel always runs first (after the matmul) or last (on the previous one's freed heap).
                order = list(kernels.items())
                for name, kernel in order if repeat % 2 == 0 else order[::-1]:
                    times[name].append(time_once(kernel, inputs, backward, clock))
                if args.rate:
                    matmul_times.append(time_matmul(clock))
            medians = {name: 1e3 * statistics.median(runs) for name, runs in times.items()}
            matmul_rate = 2 * 1024**3 / statistics.median(matmul_times) / 1e9 if args.rate else 0.0
            row = [str(seq_len), "fwd+bwd" if backward else "fwd"]
            row += [] if args.no_recurrent else [f"{medians['recurrent']:.1f}"]
            for name in chunked_names:
                row += [f"{medians[name]:.1f}"]
                row += [] if args.no_recurrent else [f"{medians['recurrent'] / medians[name]:.1f}x"]
                if args.rate:
                    chunk_size = int(name.split("C=")[1])
                    flops = (
                        (3 if backward else 1)
                        * args.batch
                        * args.heads
                        * -(-seq_len // chunk_size)
                        * kda_chunk_flops_per_chunk(chunk_size, args.head_dim, args.head_dim)
                    )
                    rate = flops / (medians[name] / 1e3) / 1e9
                    row += [f"{rate:.1f}", f"{rate / matmul_rate:.0%}"]
            row += [f"{matmul_rate:.1f}"] if args.rate else []
            print("| " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
