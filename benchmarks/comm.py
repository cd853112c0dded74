"""Bytes and messages per group of one training step, measured beside the formula's prediction.

Each layout runs one `Trainer.train_step()` of the debug model on gloo through the real code
(built as `pretrain_k3.main` builds a job: `tests/distributed/workers_comm.py`); comm.py's
`TrafficCounter`, reset after set-up, then holds exactly that step. Beside it stands
`k3train.planning.traffic.predicted_step_traffic` for the same rank (`docs/traffic.md` lists
every term). All layouts run in one 4-process launch; a 2-rank layout runs on ranks 0 and 1.

Counting convention (comm.py): bytes this rank contributes: an all-reduce of N bytes counts N,
an all-gather its local shard, a reduce-scatter its full input; one message per collective.
Rows are per group and per set of ranks with the same numbers (under ZeRO-1 the `tp` traffic
of Muon's whole-matrix gathers depends on which DP rank owns a matrix).

    OMP_NUM_THREADS=1 python benchmarks/comm.py                 # all layouts (about half a minute)
    OMP_NUM_THREADS=1 python benchmarks/comm.py --terms         # and the formula's terms per layout
    OMP_NUM_THREADS=1 python benchmarks/comm.py --layouts TP2+SP "DP2×TP2 ZeRO-1"
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

LAYOUTS = [
    dict(name="DP2", dp=2, zero1=False),
    dict(name="DP2 ZeRO-1", dp=2, zero1=True),
    dict(name="DP4", dp=4, zero1=False),
    dict(name="DP4 ZeRO-1", dp=4, zero1=True),
    dict(name="TP2", tp=2),
    dict(name="TP2+SP", tp=2, sequence_parallel=True),
    dict(name="DP2×TP2", tp=2, dp=2, zero1=False),
    dict(name="DP2×TP2 ZeRO-1", tp=2, dp=2, zero1=True),
    dict(name="DP2×TP2+SP ZeRO-1", tp=2, dp=2, sequence_parallel=True, zero1=True),
    dict(name="TP2+SP recompute=sublayer", tp=2, sequence_parallel=True, overrides=["model.recompute=sublayer"]),
]

NOT_COUNTED = (
    "Not counted by comm.py (outside its groups): the step line's per-rank memory all-gather "
    "(one float64 per rank on the default group) and, between steps in `Trainer.run`, the "
    "stop-flag all-reduce (one int32)."
)


def table(layouts: list[dict], results: list[list[dict]]) -> tuple[str, bool]:
    """Markdown rows (layout, group, ranks, measured/predicted bytes, ratio, messages) and whether
    every rank's every group matched its prediction."""
    lines = [
        "| layout | group | ranks | measured bytes | predicted bytes | ratio | measured msgs | predicted msgs |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    all_match = True
    for index, layout in enumerate(layouts):
        per_rank = [rank_results[index] for rank_results in results if rank_results[index]["member"]]
        groups = sorted({g for r in per_rank for g in (*r["measured"], *r["predicted"])})
        for group in groups:
            rows: dict[tuple, list[int]] = {}
            for rank, r in enumerate(per_rank):
                key = (tuple(r["measured"].get(group, (0, 0))), tuple(r["predicted"].get(group, (0, 0))))
                rows.setdefault(key, []).append(rank)
            for ((m_bytes, m_msgs), (p_bytes, p_msgs)), ranks in rows.items():
                all_match &= (m_bytes, m_msgs) == (p_bytes, p_msgs)
                ratio = f"{m_bytes / p_bytes:.3f}" if p_bytes else ("—" if not m_bytes else "inf")
                lines.append(
                    f"| {layout['name']} | {group} | {','.join(map(str, ranks))} | {m_bytes:,} | "
                    f"{p_bytes:,} | {ratio} | {m_msgs} | {p_msgs} |"
                )
    return "\n".join(lines), all_match


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", nargs="*", default=None, help="layout names to run (default: all)")
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=2, help="micro-batches per DP rank and step")
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--recipe", default=str(Path(__file__).resolve().parents[1] / "recipes" / "debug.yaml"))
    parser.add_argument("--terms", action="store_true", help="also print the formula's terms per layout (rank 0)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds before the workers are killed")
    args = parser.parse_args()

    layouts = LAYOUTS if args.layouts is None else [layout for layout in LAYOUTS if layout["name"] in args.layouts]
    unknown = set(args.layouts or []) - {layout["name"] for layout in layouts}
    if unknown:
        parser.error(f"unknown layouts {sorted(unknown)}; choose from {[layout['name'] for layout in LAYOUTS]}")
    from k3train.planning.traffic import TrafficTerm, describe_terms
    from tests.distributed.harness import run_workers

    payload = dict(
        recipe=args.recipe,
        micro_batch_size=args.micro_batch_size,
        micro_batches=args.micro_batches,
        seq_length=args.seq_length,
        layouts=layouts,
    )
    started = time.perf_counter()
    results = run_workers(4, "tests.distributed.workers_comm:run_layouts", payload, timeout_s=args.timeout)
    seconds = time.perf_counter() - started
    print(
        f"# One training step of {Path(args.recipe).name} per layout: micro-batch {args.micro_batch_size} × "
        f"seq {args.seq_length}, {args.micro_batches} micro-batches per DP rank, fp32, gloo\n"
    )
    text, all_match = table(layouts, results)
    print(text)
    print(
        f"\n{'every rank matches its prediction (bytes and messages)' if all_match else 'MISMATCH: see the rows'}; "
        f"{len(layouts)} layouts in {seconds:.1f} s (one 4-rank launch)"
    )
    print(NOT_COUNTED)
    if args.terms:
        for index, layout in enumerate(layouts):
            print(f"\n## {layout['name']}: predicted terms, rank 0\n")
            print(describe_terms([TrafficTerm(**term) for term in results[0][index]["terms"]]))
    return 0 if all_match else 1


if __name__ == "__main__":
    sys.exit(main())
