"""`OUT/report.md`: what was run, the table of final losses over seeds, the plots, the ladder fits.

Number formats are fixed per kind, never chosen per value: losses and differences with 4
decimals, throughput as whole tokens/s with thousands separators, parameter and FLOP counts with
three significant digits and an SI prefix (`1.23 M`, `4.56 G`).
"""

from __future__ import annotations

import math
import pathlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from k3train.ablation.curves import band_caption
from k3train.ablation.ladder import PowerLaw, compute_multiplier
from k3train.ablation.results import ArmSummary
from k3train.ablation.stats import MIN_SEEDS, Interval

SI_PREFIXES = ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


def format_loss(value: float | None) -> str:
    return "–" if value is None or not math.isfinite(value) else f"{value:.4f}"


def format_signed(value: float | None) -> str:
    return "–" if value is None or not math.isfinite(value) else f"{value:+.4f}"


def format_rate(value: float | None) -> str:
    return "–" if value is None or not math.isfinite(value) else f"{value:,.0f}"


def format_count(value: float | None) -> str:
    """Three significant digits with an SI prefix: 950, 1.23 k, 45.6 M, 7.89 T."""
    if value is None or not math.isfinite(value):
        return "–"
    for scale, prefix in SI_PREFIXES:
        if abs(value) >= scale:
            return f"{_three_digits(value / scale)} {prefix}"
    return _three_digits(value)


def _three_digits(value: float) -> str:
    """Three significant digits, trailing zeros kept (5.80, 12.0, 781)."""
    text = f"{value:#.3g}"
    return text.rstrip(".") if "e" not in text else text


def format_interval(interval: Interval | None) -> str:
    if interval is None:
        return "(baseline)"
    if interval.low is None:
        return f"{format_signed(interval.estimate)} (no interval)"
    return f"{format_signed(interval.estimate)} [{format_signed(interval.low)}, {format_signed(interval.high)}]"


def format_test(interval: Interval | None) -> str:
    """The test of the interval and its degrees of freedom (fractional for Welch's)."""
    if interval is None or interval.dof is None:
        return "–"
    dof = f"{interval.dof:.0f}" if float(interval.dof).is_integer() else f"{interval.dof:.1f}"
    return f"{interval.method}, ν = {dof}"


def reading(interval: Interval | None) -> str:
    """What the interval says, decided on the bounds as printed: a bound that prints as ±0.0000
    does not exclude 0, so the words never contradict the numbers beside them."""
    if interval is None:
        return "–"
    if interval.low is None:
        return interval.method
    low, high = float(format_signed(interval.low)), float(format_signed(interval.high))
    if low > 0:
        return "higher: interval excludes 0"
    if high < 0:
        return "lower: interval excludes 0"
    return "not distinguishable from seed noise"


def summary_table(summaries: Sequence[ArmSummary], metric: str, confidence: float) -> str:
    name = "val loss" if metric == "validation" else "train loss"
    header = [
        "variant",
        "seeds",
        "steps",
        "tokens",
        f"final {name} (mean ± std)",
        f"Δ vs baseline [{confidence:.0%} CI]",
        "test",
        "reading",
        "tok/s",
        "params",
        "active params",
        "train FLOPs/token",
        "train FLOPs",
    ]
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join(["---"] + ["---:"] * 5 + ["---"] * 2 + ["---:"] * 5) + "|",
    ]
    for s in summaries:
        if len(s.final) >= 2:
            final = f"{format_loss(s.mean)} ± {format_loss(s.std)}"
        else:
            final = f"{format_loss(s.mean)} (1 seed)" if s.final else "–"
        lines.append(
            "| "
            + " | ".join(
                [
                    s.arm,
                    str(len(s.final)),
                    f"{s.steps:,}",
                    format_count(s.tokens),
                    final,
                    format_interval(s.difference),
                    format_test(s.difference),
                    reading(s.difference),
                    format_rate(s.throughput),
                    format_count(s.parameters),
                    format_count(s.active_parameters),
                    format_count(s.flops_per_token),
                    format_count(s.trained_flops),
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def reading_rule(confidence: float) -> list[str]:
    """The report's statement of the test behind Δ and its reading (k3train/ablation/stats.py)."""
    alpha = 1 - confidence
    return [
        f"- Δ: mean(variant) − mean(baseline) ± t_(1−α/2, ν) · SE, a {confidence:.0%} Student-t interval (α = {alpha:.2g}). "
        "Paired when both ran the same seeds k (same data order and initialisation streams): over "
        "d_k = variant_k − baseline_k, SE = s_d / √n, ν = n − 1. Welch's otherwise: "
        "SE = √(s_v²/n_v + s_b²/n_b), ν = (s_v²/n_v + s_b²/n_b)² / ((s_v²/n_v)²/(n_v − 1) + (s_b²/n_b)²/(n_b − 1)). "
        "The *test* column names which, with its ν (paired differences without spread fall back to Welch's).",
        "- Reading: with no true difference, t = Δ / SE follows Student's t with ν degrees of freedom, so "
        f"|t| > t_(1−α/2, ν) happens with probability α; |Δ| > t_(1−α/2, ν) · SE is the same as the interval "
        f'excluding 0. So an interval that excludes 0 (as printed) is the two-sided t-test rejecting "no '
        f'difference" at level {alpha:.2g}: seed noise alone gives a difference that large less than {alpha:.0%} of '
        f"the time. The *reading* column says *higher* or *lower* only then. With fewer than {MIN_SEEDS} seeds per arm "
        "no claim is made: two seeds leave s one degree of freedom, and two per-seed differences that happen to "
        "coincide give s = 0, a zero-width interval that excludes 0 by accident.",
    ]


def per_seed_table(summaries: Sequence[ArmSummary]) -> str:
    seeds = sorted({seed for s in summaries for seed in s.final})
    lines = [
        "| variant | " + " | ".join(f"seed {seed}" for seed in seeds) + " |",
        "|---|" + "|".join("---:" for _ in seeds) + "|",
    ]
    for s in summaries:
        lines.append(f"| {s.arm} | " + " | ".join(format_loss(s.final.get(seed)) for seed in seeds) + " |")
    return "\n".join(lines)


@dataclass
class LadderSection:
    fits: dict[str, PowerLaw]
    points: dict[str, list[tuple[float, float]]]
    baselines: dict[str, str]
    """Each arm's baseline arm."""
    reference_losses: dict[str, float]
    """Each arm's final loss on the largest size: a baseline's is where multipliers are read."""
    plot: str | None = None

    def multipliers(self) -> dict[str, tuple[str, float, float | None]]:
        """arm → (its baseline, the loss compared at, C_baseline(L) / C_arm(L))."""
        found = {}
        for arm, law in self.fits.items():
            base = self.baselines.get(arm)
            if base == arm or base not in self.fits or base not in self.reference_losses:
                continue
            loss = self.reference_losses[base]
            found[arm] = (base, loss, compute_multiplier(law, self.fits[base], loss))
        return found

    def markdown(self) -> str:
        lines = [
            "## Ladder: loss against compute",
            "",
            "Per variant, `loss = E + a · C^(−b)` fitted to (training FLOPs, final loss mean over seeds) "
            "of its sizes, least squares in log space.",
            "",
            "| variant | sizes | a | b | E | rms log error |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for arm, law in self.fits.items():
            lines.append(
                f"| {arm} | {len(self.points[arm])} | {law.a:.4g} | {law.b:.4f} | {format_loss(law.irreducible)} "
                f"| {law.residual:.4f} |"
            )
        multipliers = self.multipliers()
        if multipliers:
            lines += [
                "",
                "Compute multiplier `C_baseline(L) / C_variant(L)` at the baseline's final loss on the "
                "largest size (> 1: the variant reaches that loss with less compute).",
                "",
                "| variant | baseline | at loss | compute multiplier |",
                "|---|---|---:|---:|",
            ]
            lines += [
                f"| {arm} | {base} | {format_loss(loss)} | {'–' if m is None else f'{m:.3f}×'} |"
                for arm, (base, loss, m) in multipliers.items()
            ]
        if self.plot:
            lines += ["", f"![loss against compute]({self.plot})"]
        return "\n".join(lines)


@dataclass
class Report:
    title: str
    command: str
    description: list[str]
    metric: str
    confidence: float
    window: int
    sizes: dict[str | None, list[ArmSummary]]
    plots: dict[str | None, list[str]] = field(default_factory=dict)
    ladder: LadderSection | None = None
    notes: list[str] = field(default_factory=list)

    def markdown(self) -> str:
        compared = (
            "the validation loss at the final step"
            if self.metric == "validation"
            else f"the mean training loss of the last {self.window} steps (not every run evaluated its final step)"
        )
        lines = [
            f"# {self.title}",
            "",
            "```",
            self.command,
            "```",
            "",
            *[f"- {d}" for d in self.description],
            f"- Compared: {compared}; mean ± sample standard deviation over seeds.",
            *reading_rule(self.confidence),
            "- tok/s: median per run after 3 warm-up steps, mean over seeds (runs that shared the machine "
            "measure each other's load too). FLOPs: model FLOPs of forward + backward "
            "(`k3train/model/flops.py`).",
            "",
        ]
        for size, summaries in self.sizes.items():
            if size is not None:
                lines += [f"## Size `{size}`", ""]
            lines += [
                summary_table(summaries, self.metric, self.confidence),
                "",
                "<details><summary>per seed</summary>",
                "",
                per_seed_table(summaries),
                "",
                "</details>",
                "",
            ]
            if self.plots.get(size):
                seeds = [len(s.final_train) for s in summaries]
                lines += [f"Plots: lines are the mean over seeds; {band_caption(seeds)}.", ""]
            for plot in self.plots.get(size, []):
                lines += [f"![{pathlib.Path(plot).stem}]({plot})", ""]
        if self.ladder is not None:
            lines += [self.ladder.markdown(), ""]
        lines += [f"- {note}" for note in self.notes]
        return "\n".join(lines).rstrip() + "\n"
