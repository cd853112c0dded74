"""Assemble and write `OUT/report.md` from the runs on disk: collect, summarise, plot, fit."""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

from k3train.ablation.grid import RunSpec, Sweep
from k3train.ablation.ladder import PowerLaw, fit_power_law
from k3train.ablation.report import LadderSection, Report, summary_table
from k3train.ablation.results import collect, compared_metric, summarise


def ladder_section(summaries, sweep: Sweep, irreducible: bool, out: pathlib.Path, plots: bool) -> LadderSection | None:
    """Fit each arm over the sizes that finished; None with fewer than two sizes."""
    points: dict[str, list[tuple[float, float]]] = {}
    for s in summaries:
        if s.final:
            points.setdefault(s.arm, []).append((s.trained_flops, s.mean))
    fits: dict[str, PowerLaw] = {}
    for arm, arm_points in points.items():
        if len({c for c, _ in arm_points}) >= (3 if irreducible else 2):
            compute, loss = zip(*arm_points)
            fits[arm] = fit_power_law(compute, loss, irreducible=irreducible)
    if not fits:
        return None
    largest = pathlib.Path(sweep.recipes[-1]).stem
    references = {}
    for arm in points:  # each arm's loss on the largest size (or its largest finished one)
        at_largest = next((s.mean for s in summaries if s.size == largest and s.arm == arm and s.final), None)
        references[arm] = at_largest if at_largest is not None else min(points[arm])[1]
    section = LadderSection(fits=fits, points=points, baselines=sweep.baseline_arms(), reference_losses=references)
    if plots:
        from k3train.ablation.plots import plot_ladder

        section.plot = plot_ladder(points, fits, out / "ladder.png").name
    return section


def describe(sweep: Sweep, runs: Sequence[RunSpec]) -> list[str]:
    lines = [
        ("Sizes (ladder): " + ", ".join(f"`{r}`" for r in sweep.recipes))
        if sweep.ladder
        else f"Base recipe: `{sweep.recipes[0]}`",
        f"Seeds: {sweep.seeds} ({', '.join(sweep.seed_fields)} = {sweep.base_seed} + k); baseline: "
        + ", ".join(f"`{b}`" for b in dict.fromkeys(sweep.baseline_arms().values())),
    ]
    if sweep.overrides:
        lines.append("Shared overrides: `" + " ".join(sweep.overrides) + "`")
    for arm in sweep.arms():
        lines.append(f"Variant `{arm.name}`: `{' '.join(arm.overrides) or '(recipe as is)'}`")
    if sweep.match:
        lines.append(
            f"Matched {sweep.match}: each variant's `train.steps` set so it trains the baseline's "
            f"{sweep.match} to within one step, and its `train.eval_interval` to a divisor of those steps "
            f"(the final step is evaluated); the table's last column shows the realised FLOPs"
        )
    return lines


def write_report(
    sweep: Sweep, runs: Sequence[RunSpec], out: pathlib.Path, command: str, args
) -> tuple[pathlib.Path, str]:
    """Write the report; returns its path and the summary table(s) for the console."""
    out.mkdir(parents=True, exist_ok=True)
    results = collect(runs, out)
    baselines = sweep.baseline_arms()
    summaries = summarise(results, baselines, args.window, args.confidence)
    metric = compared_metric(results)
    sizes: dict = {}
    for s in summaries:
        sizes.setdefault(s.size, []).append(s)
    plots: dict = {}
    if not args.no_plots:
        from k3train.ablation.plots import plot_size

        for size in sizes:
            size_results = [r for r in results if r.spec.size == size]
            prefix = f"{size}-" if size else ""
            plots[size] = [p.name for p in plot_size(size_results, baselines, out, prefix, args.smooth)]
    notes = []
    missing = len(runs) - len(results)
    if missing:
        notes.append(
            f"{missing} of {len(runs)} runs are not finished (running, failed or not started) and are left out."
        )
    report = Report(
        title=f"Ablation: {', '.join(a.name for a in sweep.arms())}",
        command=command,
        description=describe(sweep, runs),
        metric=metric,
        confidence=args.confidence,
        window=args.window,
        sizes=sizes,
        plots=plots,
        ladder=ladder_section(summaries, sweep, args.irreducible, out, not args.no_plots) if sweep.ladder else None,
        notes=notes,
    )
    path = out / "report.md"
    path.write_text(report.markdown())
    tables = "\n\n".join(
        (f"{size}:\n" if size else "") + summary_table(group, metric, args.confidence) for size, group in sizes.items()
    )
    if report.ladder is not None:
        tables += "\n\n" + report.ladder.markdown()
    return path, tables
