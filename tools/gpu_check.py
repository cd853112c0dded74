#!/usr/bin/env python
"""Check every GPU fast path against its reference and time it, in one run.

    python tools/gpu_check.py                         # every check, on CUDA (without a GPU: one line, exit 2)
    python tools/gpu_check.py --device cpu --quick    # the logic at small sizes (tests/unit runs this)
    python tools/gpu_check.py --only kda_fla --only grouped_mm --json /tmp/rows.json
    python tools/gpu_check.py --budget 480 --json first.json   # the most valuable checks that fit
    python tools/gpu_check.py --budget 480 --only NAME ...     # the rest: the first run prints this line

The checks run in three groups, in order of value (`GROUPS`): the model's CUDA kernels against
their references and the K3 training row; the remaining fast paths and the debug model; the
speed-ups, the larger model and the step against a dense peer. `--budget SECONDS` (start-up
included) starts a check only while its estimate fits in what is left (the registry's
estimates, or a previous run's measured seconds with `--estimates PATH` of its `--json`), stops
one that overruns at the budget's end (its rows so far stay), and prints what it left out with
the command that runs it (k3train/benchmarking/gpu_checks/budget.py).

Each check compares a fast path with a reference in higher precision (float64, mostly on the CPU)
and times the fast path against the path it replaces on the same device (median of several runs
after warm-up, CUDA events on the GPU). One table row per case:

    check | max abs | rel err | tol | status | ref ms | fast ms | speed-up | note

`rel err` is the norm-wise relative error ‖fast − ref‖ / ‖ref‖ of the worst tensor of the case
(outputs, final states and gradients; the note names it), `tol` the bound on it. A NaN or Inf in
a fast result always fails. What `ref ms` and `fast ms` time is in each check's docstring and the
note. SKIP rows say why (no CUDA, fla-core missing, several GPUs needed). The exit code is 1 if
any row FAILs, 0 otherwise; 2, after one line, when there is no CUDA device and `--device cpu`
was not given.

`fused_paths` holds each training fast path of the CPU work (written-out backwards of the KDA
chunk kernel, short convolution, norms, decay gate, SiTU-GLU with routing weights, the fused
AttnRes mix + norm; MLA attention with v padded to the q/k head dim) to its reference formula,
since the same code runs on the GPU.

Sizes: on CUDA without `--quick`, K3-like shapes (KDA heads of 128, 56 local experts of
3584 x 3072, 8192 slots, ...), sized to finish in a few minutes on one H200. With `--quick` or
on the CPU, small shapes that only exercise the logic.

On the device machine fla-core is not preinstalled: carry its wheel (pure Python, needs einops,
which is there) or the `kda_fla`, `kda_speed`, `kda_fla_raw`, `short_conv_fla` and `gated_norm_fla` rows SKIP and the model runs KDA
on the PyTorch path. `kda_fla_raw` checks fla's kernel on raw inputs (q/k normalisation, decay
gate and β's sigmoid inside fla's launches: the model's CUDA path) against the PyTorch path and
times it against the unfused steps. The same
holds for transformer-engine (`pip install transformer-engine[pytorch]`, a CUDA build): without
it the `transformer_engine` rows and the fp8 runs of `k3_1gpu` SKIP.

`k3_1gpu` trains recipes/k3-1gpu.yaml (every K3 feature, 1.1B active parameters) for 50 steps in
bf16 and in fp8 from the same weights and batches, compares the loss curves, and prints a table
for bf16 and fp8, with Block AttnRes and without: the forward-backward of a micro-batch and the
optimizer step timed apart (medians after warm-up), model MFU (against the GPU's dense bf16 peak
from tools/hardware/), the optimizer's time, the recipe's whole step from them (its 32
micro-batches, one optimizer step: tokens/s and MFU as the training step line reports) and peak
memory; `--json PATH` writes the rows, that
table and the loss curves. `step_vs_dense` times k3train's whole step against a dense transformer
of equal FLOPs per token (`benchmarks/step_vs_dense.py`) in bf16, at 2,048 and 16,384 tokens per
step (at 2,048 also with `train.compile=true`), and prints where one profiled step's kernel time
goes. The whole script is estimated at 7 to 17 minutes on one H200; `--budget` splits it over
calls.

This file is the driver: the registry of checks (it fixes the order of the table), the CLI and
the table. The checks live beside it in k3train/benchmarking/gpu_checks/, one module per subject; its common
module holds the rows, the timing, the error measures and the tolerances.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import json
import math
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

from k3train.benchmarking.gpu_checks import (
    device_splits,
    fused_paths,
    grouped_gemm,
    k3_1gpu,
    kda,
    model,
    newton_schulz,
    step_vs_dense,
    transformer_engine,
)
from k3train.benchmarking.gpu_checks.budget import (
    Budget,
    BudgetExceeded,
    load_estimates,
    rest_command,
    seconds_since_process_start,
)
from k3train.benchmarking.gpu_checks.common import Context, Row, describe, release
from k3train.errors import UserError

NO_GPU = 2
"""Exit status when CUDA is wanted (the default) and torch sees no device."""
USAGE_ERROR = 2
"""Exit status for unusable arguments (argparse's)."""


def package_version(module: str, distribution: str) -> str:
    """The installed version of `distribution`, "absent" if `module` cannot be found (nothing is
    imported)."""
    if importlib.util.find_spec(module) is None:
        return "absent"
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "present"


# ---------------------------------------------------------------------------------------------
# Registry and driver


@dataclasses.dataclass(frozen=True)
class Check:
    """One check: its group (`GROUPS`, in order of value) and its estimated seconds on CUDA at
    full sizes, on CUDA with `--quick`, and on the CPU (`--device cpu`, always small)."""

    name: str
    run: Callable[[Context], Iterator[Row]]
    group: str
    estimate_s: tuple[float, float, float]

    def estimate(self, ctx: Context, measured: dict[str, float]) -> float:
        if self.name in measured:
            return measured[self.name]
        full, quick, cpu = self.estimate_s
        return cpu if not ctx.cuda else quick if ctx.quick else full


GROUPS = {
    "first": "the model's CUDA kernels against their references, and the K3 training row",
    "paths": "the remaining fast paths against their references, the debug model",
    "speed": "speed-ups against the paths they replace, the larger model, the step against a dense peer",
}
"""The groups in the order they run: under `--budget` the most valuable first."""

# Estimates: CPU seconds measured here (2 cores, --device cpu --quick) with ~1.5x margin; CUDA
# sized from the parts (fla's first-call autotuning, four builds of the K3 model, compilation),
# to be replaced by a GPU run's own (`--json`, then `--estimates`).
CHECKS: list[Check] = [
    Check("kda_fla_raw", kda.check_kda_fla_raw, "first", (60, 30, 1)),
    Check("kda_fla", kda.check_kda_fla, "first", (60, 30, 1)),
    Check("short_conv_fla", kda.check_short_conv_fla, "first", (20, 10, 1)),
    Check("gated_norm_fla", kda.check_gated_norm_fla, "first", (20, 10, 1)),
    Check("grouped_mm", grouped_gemm.check_grouped_mm, "first", (20, 10, 3)),
    Check("transformer_engine", transformer_engine.check_transformer_engine, "first", (30, 20, 2)),
    Check("k3_1gpu", k3_1gpu.check_k3_1gpu, "first", (240, 90, 4)),
    Check("kda_chunk", kda.check_kda_chunk, "paths", (20, 10, 2)),
    Check("attn_res", fused_paths.check_attn_res, "paths", (10, 5, 1)),
    Check("situ_glu", fused_paths.check_situ_glu, "paths", (10, 5, 1)),
    Check("fused_paths", fused_paths.check_fused_paths, "paths", (20, 10, 4)),
    Check("newton_schulz", newton_schulz.check_newton_schulz, "paths", (15, 10, 1)),
    Check("expert_dispatch", grouped_gemm.check_expert_dispatch, "paths", (10, 10, 1)),
    Check("device_splits", device_splits.check_device_splits, "paths", (15, 10, 1)),
    Check("model_debug", model.check_model_debug, "paths", (30, 20, 5)),
    Check("kda_speed", kda.check_kda_speed, "speed", (40, 20, 1)),
    Check("grouped_mm_speed", grouped_gemm.check_grouped_mm_speed, "speed", (20, 10, 1)),
    Check("model_large", model.check_model_large, "speed", (60, 30, 1)),
    Check("step_vs_dense", step_vs_dense.check_step_vs_dense, "speed", (150, 60, 23)),
]


def run_check(ctx: Context, check: Check, budget: Budget) -> tuple[list[Row], bool]:
    """The check's rows and whether the budget stopped it; an exception becomes a FAIL row
    (traceback on stderr) after any rows it already produced."""
    rows: list[Row] = []
    stopped = False
    start = time.perf_counter()
    try:
        with budget.stop_at_deadline():
            for row in check.run(ctx):
                rows.append(row)
                print(f"  {format_row(row)}", flush=True)
    except BudgetExceeded as exc:
        stopped = True
        rows.append(Row(check.name, "SKIP", note=f"stopped after {time.perf_counter() - start:.0f} s: {exc}"))
        print(f"  {format_row(rows[-1])}", flush=True)
    except Exception as exc:
        traceback.print_exc(file=sys.stderr)
        rows.append(Row(check.name, "FAIL", note=describe(exc)))
        print(f"  {format_row(rows[-1])}", flush=True)
    release(ctx)
    print(f"  ({check.name}: {time.perf_counter() - start:.1f} s)", flush=True)
    return rows, stopped


def fmt(value: float | None, spec: str) -> str:
    if value is None:
        return "-"
    if math.isinf(value) or math.isnan(value):
        return str(value)
    return format(value, spec)


HEADER = ["check", "max abs", "rel err", "tol", "status", "ref ms", "fast ms", "speed-up", "note"]


def row_cells(row: Row) -> list[str]:
    return [
        row.name,
        fmt(row.max_abs, ".2e"),
        fmt(row.rel, ".2e"),
        fmt(row.tol, ".0e"),
        row.status,
        fmt(row.ref_ms, ".3f"),
        fmt(row.fast_ms, ".3f"),
        "-" if row.speedup is None else f"{row.speedup:.2f}x",
        row.note,
    ]


def format_row(row: Row) -> str:
    return " | ".join(row_cells(row))


def print_table(rows: list[Row]) -> None:
    cells = [HEADER] + [row_cells(r) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(HEADER) - 1)]
    for index, line in enumerate(cells):
        padded = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))]
        print("| " + " | ".join(padded + [line[-1]]) + " |")
        if index == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|------|")


def environment(ctx: Context) -> str:
    parts = [f"torch {torch.__version__}", f"device {ctx.device}"]
    if ctx.cuda:
        props = torch.cuda.get_device_properties(ctx.device)
        parts += [
            f"{props.name} (sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB)",
            f"triton {package_version('triton', 'triton')}",
            f"fla-core {package_version('fla', 'fla-core')}",
            f"transformer-engine {package_version('transformer_engine', 'transformer-engine')}",
        ]
    parts.append("quick" if ctx.quick else "full sizes" if ctx.cuda else "small sizes (CPU)")
    return ", ".join(parts)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    names = [check.name for check in CHECKS]
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="checks: " + ", ".join(names),
    )
    parser.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="cuda (default; without a CUDA device the script says so and exits 2) or cpu: "
        "the checks' logic at small sizes",
    )
    parser.add_argument("--quick", action="store_true", help="small sizes only")
    parser.add_argument(
        "--only",
        action="append",
        choices=names,
        metavar="NAME",
        help="run only this check (repeatable): " + ", ".join(names),
    )
    parser.add_argument(
        "--skip", action="append", choices=names, metavar="NAME", help="leave this check out (repeatable)"
    )
    parser.add_argument(
        "--budget",
        type=positive_seconds,
        metavar="SECONDS",
        help="wall seconds for the whole run (start-up included): checks start, in order of value, "
        "only while their estimate fits; one that overruns is stopped; what was left out is printed "
        "with the command that runs it",
    )
    parser.add_argument(
        "--estimates",
        metavar="PATH",
        help="per-check seconds from a previous run's --json (its measured times) instead of the built-in estimates",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    return parser.parse_args(argv)


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"--budget wants a positive number of seconds, got {text!r}")
    return value


def no_gpu_reason() -> str:
    """Why torch sees no CUDA device: a CPU build of torch, or no device visible to a CUDA one."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU build"
    return f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device"


def budget_line(
    args: argparse.Namespace,
    budget: Budget,
    left_out: list[str],
    selected: list[Check],
    ctx: Context,
    measured: dict[str, float],
) -> str:
    """What the budget left out, and the command that runs it (the same device and sizes)."""
    wall = budget.elapsed()
    if not left_out:
        return f"gpu_check: budget {args.budget:g} s, used {wall:.0f} s: every selected check ran, nothing left out"
    estimate = sum(c.estimate(ctx, measured) for c in selected if c.name in left_out)
    options = [f"--device {args.device}"] + (["--quick"] if args.quick else [])
    return (
        f"gpu_check: budget {args.budget:g} s, used {wall:.0f} s; left out {len(left_out)} check(s), "
        f"estimated {estimate:g} s: {', '.join(left_out)}\n"
        f"gpu_check: the rest: {rest_command(left_out, options)}"
    )


def main(argv: Sequence[str] | None = None, spent_s: float = 0.0) -> int:
    """The run; `spent_s`: seconds the process spent before (its imports), counted in `--budget`."""
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        # Without CUDA the full run would take minutes on the CPU and check nothing of the GPU.
        print(
            f"gpu_check: no GPU: {no_gpu_reason()}; run it on a machine with one, or pass --device cpu "
            f"(--quick) to check the logic on the CPU",
            file=sys.stderr,
        )
        return NO_GPU
    budget = Budget(args.budget, spent_s)
    try:
        measured = load_estimates(args.estimates)
    except UserError as exc:
        print(f"gpu_check: {exc}", file=sys.stderr)
        return USAGE_ERROR
    ctx = Context(torch.device(args.device), args.quick)
    if not ctx.cuda:
        torch.set_num_threads(min(torch.get_num_threads(), 2))
    print(f"gpu_check: {environment(ctx)}", flush=True)
    selected = [c for c in CHECKS if (args.only is None or c.name in args.only) and c.name not in (args.skip or [])]
    rows: list[Row] = []
    seconds: dict[str, float] = {}
    left_out: list[str] = []
    stopped = False
    start = time.perf_counter()
    group = None
    for check in selected:
        estimate = check.estimate(ctx, measured)
        if stopped or not budget.fits(estimate):
            left_out.append(check.name)
            print(
                f"[{check.name}] left out: estimated {estimate:g} s, {max(budget.left(), 0):.0f} s of the budget left"
            )
            continue
        if check.group != group:
            group = check.group
            print(f"== {group}: {GROUPS[group]}", flush=True)
        print(f"[{check.name}]", flush=True)
        check_start = time.perf_counter()
        check_rows, stopped = run_check(ctx, check, budget)
        rows.extend(check_rows)
        if stopped:
            left_out.append(check.name)
        else:
            seconds[check.name] = round(time.perf_counter() - check_start, 1)
    failed = [r.name for r in rows if r.status == "FAIL"]
    print(f"\ngpu_check: {environment(ctx)}; {time.perf_counter() - start:.0f} s")
    print_table(rows)
    counts = {s: sum(r.status == s for r in rows) for s in ("PASS", "FAIL", "SKIP")}
    print(
        f"gpu_check: {counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['SKIP']} SKIP"
        + (f": FAILED {', '.join(failed)}" if failed else "")
    )
    if args.budget is not None:
        print(budget_line(args, budget, left_out, selected, ctx, measured))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "environment": environment(ctx),
                    "rows": [dataclasses.asdict(r) for r in rows],
                    "seconds": seconds,
                    "left_out": left_out,
                    **ctx.results,
                },
                indent=1,
            )
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(spent_s=seconds_since_process_start()))
