#!/usr/bin/env python
"""Run recipe variants × grid × seeds as separate training runs and write a report with plots.

    python tools/ablate.py --sweep recipes/ablations/attn_res.yaml --seeds 3 --out runs/attn-res
    python tools/ablate.py --recipe recipes/ladder/cpu-tiny.yaml --out runs/lr \\
        --variant muon optimizer.name=muon --variant adamw optimizer.name=adamw \\
        --grid optimizer.lr=1e-3,3e-3 --seeds 2 --parallel 2 -- train.steps=100
    python tools/ablate.py --sweep recipes/ablations/attn_res.yaml --ladder \\
        recipes/ladder/cpu-tiny.yaml recipes/ladder/cpu-small.yaml --match flops --out runs/ladder

A sweep file (see k3train/ablation/grid.py) names a base recipe, variants, a grid and seeds; the
command-line options add to it or replace it (`--variant` adds variants, `--grid` adds grid
fields, `--seeds`/`--match`/`--baseline` replace; overrides after `--` apply to every run). Each run
is one `pretrain_k3.py` process in `OUT/[SIZE/]VARIANT/seedK`; `--parallel N` runs N at once with
`cores / N` threads each; `--nproc N` runs each under torchrun with N ranks (a sweep file may give a
variant its own: `tp2: {overrides: [parallel.tp=2], nproc: 2}`). While runs train, every
`--progress` seconds one line per running job shows its step, planned steps and last loss.
Rerunning the same command skips finished runs and resumes the others from their checkpoints
(its first line says how many of each). The report is
`OUT/report.md` with PNG plots beside it; `--report-only` rewrites it from the runs on disk.
"""

from __future__ import annotations

import argparse
import pathlib
import shlex
import sys

from k3train.ablation.grid import MATCH_MODES, Sweep, Variant, expand, load_sweep_file, parse_grid_option
from k3train.ablation.runner import LaunchOptions, SweepError, run_sweep
from k3train.config.recipe import ConfigError
from k3train.training.threads import available_cores


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    shared: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, shared = argv[:split], argv[split + 1 :]
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument("--sweep", help="a sweep file (YAML): base recipe, variants, grid, seeds")
    parser.add_argument("--recipe", help="the base recipe (replaces the sweep file's `base:`)")
    parser.add_argument("--out", required=True, help="directory of the runs and the report")
    parser.add_argument(
        "--variant",
        nargs="+",
        action="append",
        default=[],
        metavar=("NAME", "OVERRIDE"),
        help="a variant: its name, then its section.field=value overrides",
    )
    parser.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="FIELD=V1,V2",
        help="a field swept over values, crossed with every variant",
    )
    parser.add_argument(
        "--seeds",
        type=int,
        help="seeds per variant (train.seed and data.seed = base_seed + k); the report "
        "claims a difference only from 3 or more",
    )
    parser.add_argument("--baseline", help="the variant differences are taken against (default: the first)")
    parser.add_argument(
        "--match",
        choices=MATCH_MODES,
        help="give every variant the baseline's training FLOPs or tokens (steps adjusted)",
    )
    parser.add_argument(
        "--ladder",
        nargs="+",
        metavar="RECIPE",
        help="run every variant at each of these sizes and fit loss against compute",
    )
    parser.add_argument("--irreducible", action="store_true", help="ladder fits with an irreducible loss term")
    parser.add_argument("--parallel", type=int, default=1, help="runs at once (processes)")
    parser.add_argument("--nproc", type=int, default=1, help="ranks per run (torchrun --standalone)")
    parser.add_argument("--launcher", help="a full launcher instead of --nproc (e.g. 'torchrun --nnodes 2 ...')")
    parser.add_argument("--threads", type=int, help="threads per rank (default: cores / (parallel × nproc))")
    parser.add_argument("--gpus", type=int, default=0, help="GPUs on this machine, split among parallel runs")
    parser.add_argument(
        "--progress",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="seconds between progress lines (step, loss) of the running jobs; 0: every poll",
    )
    parser.add_argument("--wandb-group", help="also log every run to wandb, in this group")
    parser.add_argument("--window", type=int, default=10, help="steps averaged for the final training loss")
    parser.add_argument("--smooth", type=float, default=0.0, help="EMA weight of the past for plotted curves, [0, 1)")
    parser.add_argument("--confidence", type=float, default=0.95, help="of the intervals on differences")
    parser.add_argument("--no-plots", action="store_true", help="the report without plots (no matplotlib needed)")
    parser.add_argument("--report-only", action="store_true", help="run nothing; write the report from OUT")
    args = parser.parse_args(argv)
    if not args.sweep and not args.recipe and not args.ladder:
        parser.error("give --sweep FILE, --recipe RECIPE or --ladder RECIPE...")
    if args.parallel < 1 or args.nproc < 1:
        parser.error("--parallel and --nproc must be at least 1")
    if args.progress < 0:
        parser.error(f"--progress must be at least 0 seconds, got {args.progress}")
    if not 0.0 <= args.smooth < 1.0:
        parser.error(f"--smooth must lie in [0, 1), got {args.smooth}")
    return args, shared


def build_sweep(args: argparse.Namespace, shared: list[str]) -> Sweep:
    sweep = load_sweep_file(args.sweep) if args.sweep else Sweep(recipes=[], variants=[])
    if args.recipe:
        sweep.recipes = [args.recipe]
    if args.ladder:
        sweep.recipes, sweep.ladder = list(args.ladder), True
    cli_variants = [Variant(name, tuple(overrides)) for name, *overrides in args.variant]
    sweep.variants = [v for v in sweep.variants if v.name != "base" or not cli_variants] + cli_variants
    if not sweep.variants:
        sweep.variants = [Variant("base")]
    for text in args.grid:
        name, values = parse_grid_option(text)
        sweep.grid[name] = values
    sweep.overrides = sweep.overrides + tuple(shared)
    if args.seeds is not None:
        sweep.seeds = args.seeds
    if args.baseline is not None:
        sweep.baseline = args.baseline
    if args.match is not None:
        sweep.match = args.match
    sweep.validate()
    return sweep


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args, shared = parse_args(argv)
    from k3train.ablation.matching import apply_match
    from k3train.ablation.write import write_report

    out = pathlib.Path(args.out)
    try:
        sweep = build_sweep(args, shared)
        runs = expand(sweep)
        if sweep.match:
            runs = apply_match(runs, sweep.match, sweep.baseline_arms())
        if not args.no_plots:
            from k3train.ablation.plots import pyplot

            pyplot()  # a missing matplotlib stops here, before hours of training
        failed = []
        if not args.report_only:
            options = LaunchOptions(
                parallel=args.parallel,
                nproc=args.nproc,
                launcher=args.launcher,
                threads=args.threads,
                cores=available_cores(),
                gpus=args.gpus,
                wandb_group=args.wandb_group,
                progress_s=args.progress,
            )
            print(
                f"{len(runs)} runs, {args.parallel} at a time, {options.threads_per_rank()} thread(s) per rank; "
                f"logs in {out}/<run>/train.log",
                flush=True,
            )
            outcomes = run_sweep(runs, out, options, say=lambda line: print(line, flush=True))
            failed = [o for o in outcomes if o.status == "failed"]
            if any(o.status in ("stopped", "not started") for o in outcomes):
                print(
                    "sweep stopped by a signal (running jobs saved checkpoints); rerun the same command to resume",
                    file=sys.stderr,
                )
                return 3
        command = "python tools/ablate.py " + " ".join(shlex.quote(a) for a in argv)
        path, table = write_report(sweep, runs, out, command, args)
    except (ConfigError, SweepError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except Exception as error:
        from k3train.ablation.plots import PlotsUnavailable

        if isinstance(error, PlotsUnavailable):
            print(f"error: {error}", file=sys.stderr)
            return 2
        raise
    print(table)
    print(f"report: {path}")
    if failed:
        print(
            f"{len(failed)} run(s) failed: " + ", ".join(str(o.run_dir / "train.log") for o in failed), file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
