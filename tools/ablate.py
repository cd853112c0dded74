#!/usr/bin/env python
"""Run recipe variants side by side and print a table of their losses.

    python tools/ablate.py --recipe recipes/debug.yaml --out runs/ablate-attn-res \\
        --variant none model.attn_res=none --variant block model.attn_res=block \\
        --variant full model.attn_res=full -- train.steps=60 train.eval_interval=60

Each `--variant NAME OVERRIDE...` is one run of `pretrain_k3.py` (same recipe, seed and data,
plus its overrides and the shared ones after `--`), in `OUT/NAME`. A variant that already
finished is not run again (resume=auto picks up its checkpoint), so an interrupted ablation
continues where it stopped. `--launcher "torchrun --nproc_per_node=4"` runs each variant in
parallel layouts. The table compares the final loss, the mean of the last `--window` steps, the
last validation loss and the throughput.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import shlex
import subprocess
import sys

CHECKOUT = pathlib.Path(__file__).resolve().parents[1]


def read_metrics(run_dir: pathlib.Path) -> tuple[list[dict], list[dict]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return [], []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    steps = [r for r in records if "loss" in r and "validation_loss" not in r]
    validation = [r for r in records if "validation_loss" in r]
    return steps, validation


def summarize(name: str, run_dir: pathlib.Path, window: int) -> dict:
    steps, validation = read_metrics(run_dir)
    if not steps:
        return {"variant": name, "steps": 0}
    last = steps[-window:]
    validation_loss = validation[-1]["validation_loss"] if validation else None
    return {
        "variant": name,
        "steps": steps[-1]["step"],
        "first loss": steps[0]["loss"],
        "final loss": steps[-1]["loss"],
        f"mean last {len(last)}": sum(r["loss"] for r in last) / len(last),
        "validation": validation_loss,
        "tok/s": sum(r["tokens_per_s"] for r in last) / len(last),
    }


def format_table(rows: list[dict]) -> str:
    columns = list(dict.fromkeys(key for row in rows for key in row))

    def cell(value) -> str:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "-"
        if isinstance(value, float):
            return f"{value:,.0f}" if value >= 1000 else f"{value:.4f}"
        return str(value)

    lines = ["| " + " | ".join(columns) + " |", "| " + " | ".join("---" for _ in columns) + " |"]
    lines += ["| " + " | ".join(cell(row.get(column)) for column in columns) + " |" for row in rows]
    return "\n".join(lines)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    shared: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, shared = argv[:split], argv[split + 1:]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", required=True, help="the base recipe every variant starts from")
    parser.add_argument("--out", required=True, help="directory holding one run directory per variant")
    parser.add_argument("--variant", nargs="+", action="append", required=True, metavar=("NAME", "OVERRIDE"),
                        help="a variant: its name, then its section.field=value overrides")
    parser.add_argument("--launcher", default=sys.executable, help="how to start pretrain_k3.py (e.g. 'torchrun --nproc_per_node=4')")
    parser.add_argument("--window", type=int, default=5, help="steps averaged at the end of each run")
    args = parser.parse_args(argv)
    names = [variant[0] for variant in args.variant]
    if len(set(names)) != len(names):
        parser.error(f"variant names must be distinct, got {names}")
    return args, shared


def main(argv: list[str] | None = None) -> int:
    args, shared = parse_args(list(sys.argv[1:] if argv is None else argv))
    out = pathlib.Path(args.out)
    rows = []
    for name, *overrides in args.variant:
        run_dir = out / name
        command = [*shlex.split(args.launcher), str(CHECKOUT / "pretrain_k3.py"), "--recipe", args.recipe,
                   "--run-dir", str(run_dir), *shared, *overrides]
        print(f"== {name}: {' '.join(overrides) or '(recipe as is)'}", flush=True)
        result = subprocess.run(command, cwd=CHECKOUT)
        if result.returncode != 0:
            print(f"variant {name} failed with exit code {result.returncode}; see the output above", file=sys.stderr)
            return result.returncode
        rows.append(summarize(name, run_dir, args.window))
    table = format_table(rows)
    print(table)
    (out / "ablation.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
