"""`OUT/report.md`: what was run, the table of final losses over seeds, the plots, the ladder fits.

Number formats are fixed per kind, never chosen per value: losses and differences with 4
decimals, throughput as whole tokens/s with thousands separators, parameter and FLOP counts with
three significant digits and an SI prefix (`1.23 M`, `4.56 G`).
"""

from __future__ import annotations

import math
import pathlib
from dataclasses import dataclass, field
from typing import Optional, Sequence

from k3train.ablation.ladder import PowerLaw, compute_multiplier
from k3train.ablation.results import ArmSummary
from k3train.ablation.stats import Interval

SI_PREFIXES = ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


def format_loss(value: Optional[float]) -> str:
    return "–" if value is None or not math.isfinite(value) else f"{value:.4f}"


def format_signed(value: Optional[float]) -> str:
    return "–" if value is None or not math.isfinite(value) else f"{value:+.4f}"


def format_rate(value: Optional[float]) -> str:
    return "–" if value is None or not math.isfinite(value) else f"{value:,.0f}"


def format_count(value: Optional[float]) -> str:
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


def format_interval(interval: Optional[Interval]) -> str:
    if interval is None:
        return "(baseline)"
    if interval.low is None:
        return f"{format_signed(interval.estimate)} (no interval: {interval.method})"
    return f"{format_signed(interval.estimate)} [{format_signed(interval.low)}, {format_signed(interval.high)}]"


def summary_table(summaries: Sequence[ArmSummary], metric: str, confidence: float) -> str:
    name = "val loss" if metric == "validation" else "train loss"
    header = ["variant", "seeds", "steps", "tokens", f"final {name} (mean ± std)",
              f"Δ vs baseline [{confidence:.0%} CI]", "tok/s", "params", "active params",
              "train FLOPs/token", "train FLOPs"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    for s in summaries:
        if len(s.final) >= 2:
            final = f"{format_loss(s.mean)} ± {format_loss(s.std)}"
        else:
            final = f"{format_loss(s.mean)} (1 seed)" if s.final else "–"
        lines.append("| " + " | ".join([
            s.arm, str(len(s.final)), f"{s.steps:,}", format_count(s.tokens), final, format_interval(s.difference),
            format_rate(s.throughput), format_count(s.parameters), format_count(s.active_parameters),
            format_count(s.flops_per_token), format_count(s.trained_flops),
        ]) + " |")
    return "\n".join(lines)


def per_seed_table(summaries: Sequence[ArmSummary]) -> str:
    seeds = sorted({seed for s in summaries for seed in s.final})
    lines = ["| variant | " + " | ".join(f"seed {seed}" for seed in seeds) + " |",
             "|---|" + "|".join("---:" for _ in seeds) + "|"]
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
    plot: Optional[str] = None

    def multipliers(self) -> dict[str, tuple[str, float, Optional[float]]]:
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
        lines = ["## Ladder: loss against compute", "",
                 "Per variant, `loss = E + a · C^(−b)` fitted to (training FLOPs, final loss mean over seeds) "
                 "of its sizes, least squares in log space.", "",
                 "| variant | sizes | a | b | E | rms log error |", "|---|---:|---:|---:|---:|---:|"]
        for arm, law in self.fits.items():
            lines.append(f"| {arm} | {len(self.points[arm])} | {law.a:.4g} | {law.b:.4f} | {format_loss(law.irreducible)} "
                         f"| {law.residual:.4f} |")
        multipliers = self.multipliers()
        if multipliers:
            lines += ["", "Compute multiplier `C_baseline(L) / C_variant(L)` at the baseline's final loss on the "
                          "largest size (> 1: the variant reaches that loss with less compute).", "",
                      "| variant | baseline | at loss | compute multiplier |", "|---|---|---:|---:|"]
            lines += [f"| {arm} | {base} | {format_loss(loss)} | {'–' if m is None else f'{m:.3f}×'} |"
                      for arm, (base, loss, m) in multipliers.items()]
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
    sizes: dict[Optional[str], list[ArmSummary]]
    plots: dict[Optional[str], list[str]] = field(default_factory=dict)
    ladder: Optional[LadderSection] = None
    notes: list[str] = field(default_factory=list)

    def markdown(self) -> str:
        compared = ("the validation loss at the final step" if self.metric == "validation"
                    else f"the mean training loss of the last {self.window} steps (not every run evaluated its final step)")
        lines = [f"# {self.title}", "", "```", self.command, "```", "", *[f"- {d}" for d in self.description],
                 f"- Compared: {compared}; mean ± sample standard deviation over seeds.",
                 f"- Δ: variant − baseline with a {self.confidence:.0%} Student-t confidence interval, paired over "
                 "seeds when both ran the same seeds (same data order and initialisation streams), Welch's otherwise. "
                 "An interval that excludes 0 is a difference the seeds' noise does not explain.",
                 "- tok/s: median per run after 3 warm-up steps, mean over seeds (runs that shared the machine "
                 "measure each other's load too). FLOPs: model FLOPs of forward + backward "
                 "(`k3train/model/flops.py`).", ""]
        for size, summaries in self.sizes.items():
            if size is not None:
                lines += [f"## Size `{size}`", ""]
            lines += [summary_table(summaries, self.metric, self.confidence), "",
                      "<details><summary>per seed</summary>", "", per_seed_table(summaries), "", "</details>", ""]
            for plot in self.plots.get(size, []):
                lines += [f"![{pathlib.Path(plot).stem}]({plot})", ""]
        if self.ladder is not None:
            lines += [self.ladder.markdown(), ""]
        lines += [f"- {note}" for note in self.notes]
        return "\n".join(lines).rstrip() + "\n"
