#!/usr/bin/env python
"""Check every GPU fast path against its reference and time it, in one run.

    python tools/gpu_check.py                         # every check, on CUDA (without a GPU: one line, exit 2)
    python tools/gpu_check.py --device cpu --quick    # the logic at small sizes (tests/unit runs this)
    python tools/gpu_check.py --only kda_fla --only grouped_mm --json /tmp/rows.json

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
of tokens/s, TFLOP/s, MFU (against the GPU's dense bf16 peak from tools/hardware/) and peak
memory for bf16 and fp8, with Block AttnRes and without; `--json PATH` writes the rows, that
table and the loss curves. `step_vs_dense` times k3train's whole step against a dense transformer
of equal FLOPs per token (`benchmarks/step_vs_dense.py`) in bf16, at 2,048 and 16,384 tokens per
step (at 2,048 also with `train.compile=true`), and prints where one profiled step's kernel time
goes. The whole script is sized for under
8 minutes on one H200.

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
    fused_paths,
    grouped_gemm,
    k3_1gpu,
    kda,
    model,
    newton_schulz,
    step_vs_dense,
    transformer_engine,
)
from k3train.benchmarking.gpu_checks.common import Context, Row, describe, release

NO_GPU = 2
"""Exit status when CUDA is wanted (the default) and torch sees no device."""


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
    name: str
    run: Callable[[Context], Iterator[Row]]


CHECKS: list[Check] = [
    Check("kda_chunk", kda.check_kda_chunk),
    Check("kda_fla", kda.check_kda_fla),
    Check("kda_speed", kda.check_kda_speed),
    Check("kda_fla_raw", kda.check_kda_fla_raw),
    Check("short_conv_fla", kda.check_short_conv_fla),
    Check("gated_norm_fla", kda.check_gated_norm_fla),
    Check("grouped_mm", grouped_gemm.check_grouped_mm),
    Check("grouped_mm_speed", grouped_gemm.check_grouped_mm_speed),
    Check("attn_res", fused_paths.check_attn_res),
    Check("situ_glu", fused_paths.check_situ_glu),
    Check("fused_paths", fused_paths.check_fused_paths),
    Check("newton_schulz", newton_schulz.check_newton_schulz),
    Check("model_debug", model.check_model_debug),
    Check("model_large", model.check_model_large),
    Check("expert_dispatch", grouped_gemm.check_expert_dispatch),
    Check("transformer_engine", transformer_engine.check_transformer_engine),
    Check("k3_1gpu", k3_1gpu.check_k3_1gpu),
    Check("step_vs_dense", step_vs_dense.check_step_vs_dense),
]


def run_check(ctx: Context, check: Check) -> list[Row]:
    """The check's rows; an exception becomes a FAIL row (traceback on stderr) after any rows it
    already produced."""
    rows: list[Row] = []
    start = time.perf_counter()
    try:
        for row in check.run(ctx):
            rows.append(row)
            print(f"  {format_row(row)}", flush=True)
    except Exception as exc:
        traceback.print_exc(file=sys.stderr)
        rows.append(Row(check.name, "FAIL", note=describe(exc)))
        print(f"  {format_row(rows[-1])}", flush=True)
    release(ctx)
    print(f"  ({check.name}: {time.perf_counter() - start:.1f} s)", flush=True)
    return rows


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
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    return parser.parse_args(argv)


def no_gpu_reason() -> str:
    """Why torch sees no CUDA device: a CPU build of torch, or no device visible to a CUDA one."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU build"
    return f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        # Without CUDA the full run would take minutes on the CPU and check nothing of the GPU.
        print(
            f"gpu_check: no GPU: {no_gpu_reason()}; run it on a machine with one, or pass --device cpu "
            f"(--quick) to check the logic on the CPU",
            file=sys.stderr,
        )
        return NO_GPU
    ctx = Context(torch.device(args.device), args.quick)
    if not ctx.cuda:
        torch.set_num_threads(min(torch.get_num_threads(), 2))
    print(f"gpu_check: {environment(ctx)}", flush=True)
    selected = [c for c in CHECKS if args.only is None or c.name in args.only]
    rows: list[Row] = []
    start = time.perf_counter()
    for check in selected:
        print(f"[{check.name}]", flush=True)
        rows.extend(run_check(ctx, check))
    failed = [r.name for r in rows if r.status == "FAIL"]
    print(f"\ngpu_check: {environment(ctx)}; {time.perf_counter() - start:.0f} s")
    print_table(rows)
    counts = {s: sum(r.status == s for r in rows) for s in ("PASS", "FAIL", "SKIP")}
    print(
        f"gpu_check: {counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['SKIP']} SKIP"
        + (f": FAILED {', '.join(failed)}" if failed else "")
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"environment": environment(ctx), "rows": [dataclasses.asdict(r) for r in rows], **ctx.results},
                indent=1,
            )
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
