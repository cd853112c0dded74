"""Exposed expert all-to-all time with and without the overlapped schedule, side by side.

Each layout trains the debug recipe for a few steps on 4 gloo ranks (`torchrun`, one launch per
row) with the expert-parallel group's collectives delayed as a link of `--bandwidth` GB/s and
`--latency` µs would (`parallel.emulate_network`: the wait sleeps, so the emulated wire costs
no CPU), once with `parallel.ep_overlap_chunks=0` and once per `--chunks` value. Per row: rank
0's seconds waited in the `ep` collectives per step (metrics.jsonl `exposed_comm_s`, mean over
the steps after the first), the step time, the ratio of exposed EP time to the unoverlapped
run's, and the last step's loss (equal across rows: the schedules compute the same sums).

`--dispatcher`: one MoE layer's dispatcher alone on 2 ranks (`tests/distributed/
workers_ep_overlap.py`, one launch for every row), forward and backward timed: what the schedule
hides when nothing else competes for the two cores. `--model`: the whole model's forward and
backward of one micro-batch (PP2×EP2: two, through the pipeline schedule; no data loader, no
optimizer, replicas placed once per step), every
row in one launch, alternated `--repeats` times: what the schedules hide without the step's
other waits (routing imbalance between the EP ranks, the step replicas' gradients going home).

    OMP_NUM_THREADS=1 python benchmarks/ep_overlap.py                         # TP2×EP2 and PP2×EP2
    OMP_NUM_THREADS=1 python benchmarks/ep_overlap.py --bandwidth 0.05 --chunks 2 4
    OMP_NUM_THREADS=1 python benchmarks/ep_overlap.py --chunks 2 --halves    # the alternating halves too
    OMP_NUM_THREADS=1 python benchmarks/ep_overlap.py --dispatcher --bandwidth 0.05
    OMP_NUM_THREADS=1 python benchmarks/ep_overlap.py --model --layouts TP2×EP2 PP2×EP2 EP2 --chunks 2 --halves --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LAYOUTS = {
    "TP2×EP2": ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=2"],
    "PP2×EP2": ["parallel.pp=2", "parallel.ep=2"],
    "EP2": ["parallel.ep=2"],  # 2 ranks: one process per core on a 2-core machine
}
RANKS = {"TP2×EP2": 4, "PP2×EP2": 4, "EP2": 2}
MODEL_LAYOUTS = {"TP2×EP2": (2, 1), "PP2×EP2": (1, 2), "EP2": (1, 1)}  # `--model`: (tp, pp)


def run(name: str, chunks: int, args, run_dir: Path, halves: bool = False) -> dict:
    layout = LAYOUTS[name]
    network = f"parallel.emulate_network={{ep: [{args.bandwidth}, {args.latency}]}}"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={RANKS[name]}",
        str(ROOT / "pretrain_k3.py"),
        "--recipe",
        str(ROOT / "recipes" / "debug.yaml"),
        "--run-dir",
        str(run_dir),
        *layout,
        f"train.steps={args.steps}",
        "parallel.ep_transport=" + args.transport,
        f"parallel.ep_overlap_chunks={chunks}",
        f"parallel.ep_overlap_halves={str(halves).lower()}",
        "checkpoint.interval=0",
        "train.eval_interval=0",
        network,
        *args.overrides,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        raise SystemExit(f"ep_overlap: {name} chunks={chunks} halves={halves} failed:\n{done.stderr[-2000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [row for row in rows if "exposed_comm_s" in row][1:]  # the first step warms up
    exposed = [sum(s for label, s in row["exposed_comm_s"].items() if label.split(".")[0] == "ep") for row in steps]
    return {
        "ep_exposed_s": sum(exposed) / len(exposed),
        "step_s": sum(row["step_time_s"] for row in steps) / len(steps),
        "loss": steps[-1]["loss"],
    }


def dispatcher_table(args) -> None:
    sys.path.insert(0, str(ROOT))
    from tests.distributed.harness import run_workers

    specs = [
        {
            "chunks": chunks,
            "inner": args.inner,
            "tokens": args.tokens,
            "transport": args.transport,
            "bandwidth_gbps": args.bandwidth,
            "latency_us": args.latency,
            "repeats": 5,
        }
        for chunks in [0, *args.chunks]
    ]
    results = run_workers(2, "tests.distributed.workers_ep_overlap:run", specs, timeout_s=args.timeout)[0]
    print(
        f"one MoE layer's dispatcher, 2 gloo ranks, {args.tokens} tokens × top-4, 4 experts per rank of "
        f"inner width {args.inner}, EP link {args.bandwidth} GB/s + {args.latency} µs, ep_transport={args.transport}"
    )
    print("| ep_overlap_chunks | forward + backward s | exposed EP s | exposed vs chunks=0 |")
    print("| ---: | ---: | ---: | ---: |")
    baseline = results[0]["ep_exposed_s"]
    for spec, result in zip(specs, results):
        print(
            f"| {spec['chunks']} | {result['layer_s']:.3f} | {result['ep_exposed_s']:.3f} | "
            f"{result['ep_exposed_s'] / baseline:.0%} |"
        )


def model_table(args) -> None:
    sys.path.insert(0, str(ROOT))
    from tests.distributed.harness import run_workers

    rows = [(0, False), *((chunks, False) for chunks in args.chunks)]
    if args.halves:
        rows += [(chunks, True) for chunks in args.chunks]
    print(
        f"the debug recipe's model ({' '.join(args.overrides) or 'no overrides'}): forward and backward of one "
        f"micro-batch (PP: one per stage, 1F1B), no data or optimizer, EP link {args.bandwidth} GB/s + {args.latency} µs, "
        f"ep_transport={args.transport}, step replicas, median of {args.repeats} alternated runs"
    )
    print("| layout | ep_overlap_chunks | halves | forward + backward s | exposed EP s | exposed vs chunks=0 |")
    print("| --- | ---: | --- | ---: | ---: | ---: |")
    for name in args.layouts:
        if name not in MODEL_LAYOUTS:
            raise SystemExit(
                f"ep_overlap --model runs {', '.join(MODEL_LAYOUTS)} (the pipeline needs the job), not {name}"
            )
        payload = {
            "recipe": str(ROOT / "recipes" / "debug.yaml"),
            "overrides": list(args.overrides),
            "tp": MODEL_LAYOUTS[name][0],
            "pp": MODEL_LAYOUTS[name][1],
            "rows": rows,
            "transport": args.transport,
            "bandwidth_gbps": args.bandwidth,
            "latency_us": args.latency,
            "repeats": args.repeats,
        }
        ranks = RANKS[name]
        results = run_workers(
            ranks, "tests.distributed.workers_ep_overlap:model_timing", payload, timeout_s=args.timeout
        )[0]
        baseline = results[0]["ep_exposed_s"]
        for (chunks, halves), result in zip(rows, results):
            print(
                f"| {name} | {chunks} | {'yes' if halves else 'no'} | {result['seconds']:.3f} | "
                f"{result['ep_exposed_s']:.3f} | {result['ep_exposed_s'] / baseline:.0%} |",
                flush=True,
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="+", default=["TP2×EP2", "PP2×EP2"], choices=list(LAYOUTS))
    parser.add_argument("--chunks", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--bandwidth", type=float, default=0.1, help="emulated EP link, GB/s")
    parser.add_argument("--latency", type=float, default=50.0, help="emulated EP link, µs")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=1, help="runs per row, alternated; medians printed")
    parser.add_argument("--transport", default="splits")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument(
        "--halves", action="store_true", help="also each --chunks value with parallel.ep_overlap_halves=true"
    )
    parser.add_argument("--dispatcher", action="store_true", help="one MoE layer's dispatcher alone")
    parser.add_argument("--model", action="store_true", help="the model's forward and backward alone (no pipeline)")
    parser.add_argument("--inner", type=int, default=512, help="--dispatcher: the experts' inner width")
    parser.add_argument("--tokens", type=int, default=1024, help="--dispatcher: tokens per rank")
    parser.add_argument("overrides", nargs="*", help="more recipe overrides (key=value)")
    args = parser.parse_args(argv)
    if args.dispatcher:
        dispatcher_table(args)
        return 0
    if args.model:
        model_table(args)
        return 0
    print(
        f"debug recipe on gloo, EP link {args.bandwidth} GB/s + {args.latency} µs, "
        f"ep_transport={args.transport}, {args.steps} steps (first one left out)"
    )
    print(
        "| layout | ep_overlap_chunks | halves | exposed EP s/step (median) | step s | exposed vs chunks=0 | last loss |"
    )
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: |")
    runs = [(0, False), *((chunks, False) for chunks in args.chunks)]
    if args.halves:
        runs += [(chunks, True) for chunks in args.chunks]
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.layouts:
            # `--repeats`: the rows' runs alternated, medians printed (4 processes on 2 cores are noisy)
            results: dict[tuple[int, bool], list[dict]] = {row: [] for row in runs}
            for repeat in range(args.repeats):
                for chunks, halves in runs:
                    where = Path(scratch) / f"{name}-{chunks}-{halves}-{repeat}"
                    results[(chunks, halves)].append(run(name, chunks, args, where, halves))
            baseline = statistics.median(r["ep_exposed_s"] for r in results[runs[0]])
            for chunks, halves in runs:
                rows = results[(chunks, halves)]
                exposed = statistics.median(r["ep_exposed_s"] for r in rows)
                each = "" if len(rows) == 1 else " (" + ", ".join(f"{r['ep_exposed_s']:.3f}" for r in rows) + ")"
                print(
                    f"| {name} | {chunks} | {'yes' if halves else 'no'} | {exposed:.3f}{each} | "
                    f"{statistics.median(r['step_s'] for r in rows):.3f} | {exposed / baseline:.0%} | "
                    f"{rows[-1]['loss']:.6f} |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
