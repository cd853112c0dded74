"""The report's PNG plots (matplotlib, an optional dependency: `pip install matplotlib` or the
`ablate` extra). Every figure puts one arm per colour: its mean over seeds as a line and the
min–max over seeds as a band, against training tokens. An arm of one seed has no band: its legend
entry and the figure's title say so rather than promise a spread that is not there."""

from __future__ import annotations

import pathlib
from collections.abc import Callable, Sequence

from k3train.ablation.curves import Band, band, band_caption, ema
from k3train.ablation.ladder import PowerLaw
from k3train.ablation.results import RunResult

INSTALL_HINT = "the ablation report's plots need matplotlib: pip install matplotlib (or pip install -e '.[ablate]'), or pass --no-plots"
FIGSIZE = (6.4, 3.4)
DPI = 80


class PlotsUnavailable(RuntimeError):
    pass


def pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, never a window
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotsUnavailable(INSTALL_HINT) from None
    return plt


Series = Callable[[RunResult], tuple[Sequence[float], Sequence[float | None]]]


def step_series(name: str, smoothing: float = 0.0) -> Series:
    def series(result: RunResult):
        return result.tokens, ema(result.curves.series.get(name, []), smoothing)

    return series


def validation_series(result: RunResult):
    per_step = result.cost.tokens_per_step
    return [s * per_step for s in result.curves.validation_steps], result.curves.validation_loss


def arm_bands(results: Sequence[RunResult], series: Series) -> dict[str, Band]:
    by_arm: dict[str, list] = {}
    for result in results:
        by_arm.setdefault(result.spec.arm, []).append(series(result))
    bands = {arm: band(members) for arm, members in by_arm.items()}
    return {arm: b for arm, b in bands.items() if b is not None}


def difference_bands(results: Sequence[RunResult], series: Series, baselines: dict[str, str]) -> dict[str, Band]:
    """Per arm, the per-seed difference to its baseline arm's run of the same seed, then mean and
    min–max over seeds (the paired view the table's interval uses)."""
    reference = {(r.spec.arm, r.spec.seed_index): dict(zip(*series(r))) for r in results}
    by_arm: dict[str, list] = {}
    for result in results:
        baseline_arm = baselines.get(result.spec.arm)
        base = reference.get((baseline_arm, result.spec.seed_index)) if baseline_arm is not None else None
        if baseline_arm == result.spec.arm or base is None:
            continue
        xs, ys = series(result)
        pairs = [(x, y - b) for x, y in zip(xs, ys) if y is not None and (b := base.get(x)) is not None]
        by_arm.setdefault(result.spec.arm, []).append(([p[0] for p in pairs], [p[1] for p in pairs]))
    bands = {arm: band(members) for arm, members in by_arm.items()}
    return {arm: b for arm, b in bands.items() if b is not None}


def legend_label(arm: str, b: Band) -> str:
    return f"{arm} (1 seed: no band)" if b.seeds < 2 else arm


def _draw(axis, bands: dict[str, Band], colours: dict[str, str]) -> None:
    for arm, b in bands.items():
        axis.plot(b.x, b.mean, label=legend_label(arm, b), color=colours[arm], linewidth=1.2)
        if b.seeds >= 2 and any(lo != hi for lo, hi in zip(b.low, b.high)):
            axis.fill_between(b.x, b.low, b.high, color=colours[arm], alpha=0.2, linewidth=0)


def figure_title(subject: str, panels: list[tuple[str, dict[str, Band]]]) -> str:
    """`subject (…, band: …)` from the seeds of the bands actually drawn."""
    return f"{subject} ({band_caption(b.seeds for _, bands in panels for b in bands.values())})"


def _figure(
    plt,
    panels: list[tuple[str, dict[str, Band]]],
    colours,
    path: pathlib.Path,
    title: str,
    zero_line: bool = False,
    log_y: bool = False,
) -> pathlib.Path | None:
    panels = [(label, bands) for label, bands in panels if bands]
    if not panels:
        return None
    figure, axes = plt.subplots(
        1, len(panels), figsize=(FIGSIZE[0] * (1 if len(panels) == 1 else 1.6), FIGSIZE[1]), squeeze=False
    )
    for axis, (label, bands) in zip(axes[0], panels):
        _draw(axis, bands, colours)
        if zero_line:
            axis.axhline(0.0, color="0.4", linewidth=0.8, linestyle="--")
        if log_y:
            axis.set_yscale("log")
        axis.set_xlabel("training tokens")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
        axis.ticklabel_format(axis="x", style="sci", scilimits=(0, 0))
    axes[0][0].legend(fontsize=8)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=DPI)
    plt.close(figure)
    return path


def plot_size(
    results: Sequence[RunResult], baselines: dict[str, str], out: pathlib.Path, prefix: str = "", smoothing: float = 0.0
) -> list[pathlib.Path]:
    """The figures of one size; returns the files written."""
    plt = pyplot()
    arms = list(dict.fromkeys(r.spec.arm for r in results))
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colours = {arm: palette[i % len(palette)] for i, arm in enumerate(arms)}
    smoothed = f" (EMA {smoothing:g})" if smoothing else ""
    train = step_series("loss", smoothing)
    loss = [
        (f"train loss{smoothed}", arm_bands(results, train)),
        ("validation loss", arm_bands(results, validation_series)),
    ]
    difference = [
        (f"Δ train loss{smoothed}", difference_bands(results, train, baselines)),
        ("Δ validation loss", difference_bands(results, validation_series, baselines)),
    ]
    experts = [
        ("expert load max/mean", arm_bands(results, step_series("expert_load_max_over_mean", smoothing))),
        ("dropped slots per step", arm_bands(results, step_series("dropped_tokens"))),
    ]
    gradients = [
        (f"grad norm{smoothed}", arm_bands(results, step_series("grad_norm", smoothing))),
        ("tokens/s", arm_bands(results, step_series("tokens_per_s"))),
    ]
    baseline_names = ", ".join(sorted(set(baselines.values())))
    written = [
        _figure(plt, loss, colours, out / f"{prefix}loss.png", figure_title("loss, mean over seeds", loss)),
        _figure(
            plt,
            difference,
            colours,
            out / f"{prefix}loss_difference.png",
            figure_title(f"difference to {baseline_names}, same seed; < 0 is better", difference),
            zero_line=True,
        ),
        _figure(
            plt,
            experts,
            colours,
            out / f"{prefix}experts.png",
            figure_title("routing: the busiest expert over the mean, max over MoE layers", experts),
        ),
        _figure(
            plt,
            gradients,
            colours,
            out / f"{prefix}grad_norm_throughput.png",
            figure_title("gradient norm (before clipping) and throughput", gradients),
            log_y=False,
        ),
    ]
    return [path for path in written if path is not None]


def plot_ladder(
    points: dict[str, list[tuple[float, float]]], fits: dict[str, PowerLaw], path: pathlib.Path
) -> pathlib.Path:
    """Final loss against training FLOPs per arm (log–log), with each arm's fitted power law."""
    plt = pyplot()
    figure, axis = plt.subplots(figsize=FIGSIZE)
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (arm, arm_points) in enumerate(points.items()):
        colour = palette[i % len(palette)]
        xs, ys = zip(*sorted(arm_points))
        axis.scatter(xs, ys, color=colour, s=14, label=arm)
        if arm in fits:
            low, high = min(xs), max(xs)
            grid = [low * (high / low) ** (k / 50) for k in range(51)]
            axis.plot(grid, [fits[arm].loss(c) for c in grid], color=colour, linewidth=1)
    axis.set_xscale("log")
    axis.set_yscale("log")
    axis.set_xlabel("training FLOPs")
    axis.set_ylabel("final loss")
    axis.grid(alpha=0.3, which="both")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=DPI)
    plt.close(figure)
    return path
