"""Checkpoint I/O costs: the CRC-32 checksums on save and load, and the training stall of a
synchronous vs an asynchronous save.

Two states: the debug model (recipes/debug.yaml) with AdamW state and the job's extras, and a
state of large fp32 tensors (`--gb`, default 1). For each: save time with and without the
checksums (the "without" run stubs out `checksum_files`), load time with and without their
verification, and the ratios. Then the stall: the time `save()` keeps the training loop waiting,
synchronous vs `async_save=True`, and the mean step time of the debug model around a save.

    OMP_NUM_THREADS=1 python benchmarks/checkpoint_io.py             # debug model + 1 GB
    OMP_NUM_THREADS=1 python benchmarks/checkpoint_io.py --gb 0.25 --repeats 2
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import k3train.checkpoint.checkpointer as checkpointer_module
import k3train.checkpoint.writing as writing_module
from k3train.checkpoint import Checkpointer
from k3train.checkpoint.verify import verify_checkpoint


def debug_model_state() -> tuple[torch.nn.Module, torch.optim.Optimizer, Callable[[], None]]:
    from k3train.config import load_config
    from k3train.model.k3 import K3ModelChunk

    config = load_config(str(Path(__file__).resolve().parents[1] / "recipes" / "debug.yaml"), [])
    torch.manual_seed(0)
    model = K3ModelChunk(config.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, config.model.vocab_size, (config.train.micro_batch_size, config.data.seq_length))

    def step() -> None:
        logits = model(tokens)
        logits = logits[0] if isinstance(logits, tuple) else logits
        logits.float().square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # optimizer state exists
    return model, optimizer, step


def big_state(gb: float) -> dict[str, Any]:
    per = 64 << 20  # 256 MiB fp32 tensors
    count = max(1, round(gb * 1e9 / (per * 4)))
    g = torch.Generator().manual_seed(0)
    return {"big": {f"t{i}": torch.randn(per, generator=g) for i in range(count)}, "progress": {"step": 1}}


def timed(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def paired(first: Callable[[], Any], second: Callable[[], Any], repeats: int) -> tuple[float, float]:
    """Median times of `first` and `second`, run alternately (disk and machine noise hit both)."""
    a, b = [], []
    for _ in range(repeats):
        a.append(timed(first, 1))
        b.append(timed(second, 1))
    return statistics.median(a), statistics.median(b)


class _Patched:
    """Replace `module.name` for the duration of a call."""

    def __init__(self, module: Any, name: str, value: Any) -> None:
        self.module, self.name, self.value = module, name, value

    def __call__(self, fn: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            original = getattr(self.module, self.name)
            setattr(self.module, self.name, self.value)
            try:
                return fn()
            finally:
                setattr(self.module, self.name, original)

        return run


def io_costs(name: str, app_state: Callable[[], dict[str, Any]], root: Path, repeats: int) -> None:
    ck = Checkpointer(root, keep_last=1)
    step = iter(range(1, 10_000))
    save = lambda: ck.save(next(step), app_state())  # noqa: E731
    without_sums = _Patched(writing_module, "checksum_files", lambda tmp, names: {})(save)
    with_sums, without = paired(save, without_sums, repeats)
    path = ck.save(next(step), app_state())
    names = [p.name for p in path.iterdir() if p.name != "k3train.json"]
    crc_only = timed(lambda: writing_module.checksum_files(path, names), repeats)
    size = sum((path / n).stat().st_size for n in names)
    load = lambda: ck.load(path, app_state())  # noqa: E731
    unverified = _Patched(
        checkpointer_module, "verify_checkpoint", lambda p, share=(0, 1): verify_checkpoint(p, checksums=False)
    )(load)
    load_with, load_without = paired(load, unverified, repeats)
    print(
        f"{name:<14} {size / 1e6:8.1f} MB | save {without:6.3f}s → {with_sums:6.3f}s with checksums "
        f"(×{with_sums / without:.2f}) | load {load_without:6.3f}s → {load_with:6.3f}s verified "
        f"(×{load_with / load_without:.2f}) | CRC-32 alone {crc_only:6.3f}s ({size / crc_only / 1e9:.2f} GB/s, "
        f"{crc_only / without * 100:.0f}% of a save, {crc_only / load_without * 100:.0f}% of a load)"
    )


def stall(root: Path, steps: int) -> None:
    model, optimizer, train_step = debug_model_state()
    state = lambda: {"model": model, "optimizer": optimizer, "progress": {"step": 0}}  # noqa: E731
    plain = timed(train_step, steps)
    for async_save in (False, True):
        ck = Checkpointer(root / f"async_{async_save}", keep_last=2, async_save=async_save)
        ck.save(0, state())
        ck.wait()
        start = time.perf_counter()
        ck.save(1, state())
        in_save = time.perf_counter() - start
        after = [timed(train_step, 1) for _ in range(steps)]
        start = time.perf_counter()
        ck.wait()
        waited = time.perf_counter() - start
        print(
            f"debug model, {'async' if async_save else 'sync ':<5} save: training waits {in_save * 1e3:8.1f} ms in "
            f"save() (+{waited * 1e3:.1f} ms at wait()); next {steps} steps {statistics.mean(after) * 1e3:.1f} ms "
            f"each (without a save: {plain * 1e3:.1f} ms)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=1.0, help="size of the large-tensor state (GB)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="debug-model steps timed after a save")
    args = parser.parse_args()
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="k3train_ckpt_bench_"))
    try:
        model, optimizer, _ = debug_model_state()
        extras = {"progress": {"step": 1}, "data": {"consumed_samples": 8, "taken_per_dataset": [8]}}
        io_costs(
            "debug model", lambda: {"model": model, "optimizer": optimizer, **extras}, root / "debug", args.repeats
        )
        big = big_state(args.gb)
        io_costs(f"{args.gb:g} GB state", lambda: big, root / "big", args.repeats)
        big = {}  # free the state before the stall test (the lambda reads the name, not the value)
        stall(root / "stall", args.steps)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
