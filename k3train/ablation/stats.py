"""Seed statistics: mean, sample standard deviation, and Student-t confidence intervals.

The t quantile is computed, not looked up: the CDF of Student's t with `ν` degrees of freedom is
`1 − ½·I_{ν/(ν+t²)}(ν/2, ½)` for `t ≥ 0` (`I` the regularised incomplete beta function, evaluated
by its continued fraction, Numerical Recipes §6.4), and the quantile is found by bisection. This
avoids a scipy dependency for one function, works for any `ν` (Welch's intervals have fractional
degrees of freedom, which a printed table cannot serve), and is checked against published values
(`t_{0.975}(1) = 12.7062`, `t_{0.975}(2) = 4.3027`, `t_{0.975}(10) = 2.2281`) in the tests.

Differences to the baseline, and the test behind the report's reading rule. Under "no difference"
the statistic `t = Δ / SE` follows Student's t with `ν` degrees of freedom, so
`P(|t| > t_{1−α/2, ν}) = α`; `|Δ| > t_{1−α/2, ν} · SE` is the same as 0 lying outside
`Δ ± t_{1−α/2, ν} · SE`. An interval that excludes 0 is therefore exactly a two-sided t-test
rejecting "no difference" at level α.

- Paired (both arms ran the same seeds: the same data order and initialisation streams): over
  `d_k = variant_k − baseline_k`, `SE = s_d / √n`, `ν = n − 1`. It removes the noise the seeds share.
- Welch's otherwise: `SE = √(s_v²/n_v + s_b²/n_b)`, `ν` by Welch–Satterthwaite,
  `(s_v²/n_v + s_b²/n_b)² / ((s_v²/n_v)²/(n_v − 1) + (s_b²/n_b)²/(n_b − 1))`.

Below `MIN_SEEDS` seeds per arm there is no interval at all: with two seeds `s` rests on one
degree of freedom, and two paired differences that happen to coincide give `s_d = 0`, a
zero-width interval that "excludes" 0 by accident. Paired differences with no spread at three
seeds or more fall back to Welch's interval (each arm's own spread), and no spread there either
gives no interval.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


def mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values)


def sample_std(values: Sequence[float]) -> float:
    """Standard deviation with Bessel's correction (`n − 1`); 0 for a single value."""
    if len(values) < 2:
        return 0.0
    centre = mean(values)
    return math.sqrt(math.fsum((v - centre) ** 2 for v in values) / (len(values) - 1))


def _beta_continued_fraction(a: float, b: float, x: float) -> float:
    tiny, eps = 1e-300, 1e-15
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        m2 = 2 * m
        for numerator in (
            m * (b - m) * x / ((qam + m2) * (a + m2)),
            -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            break
    return h


def regularized_incomplete_beta(a: float, b: float, x: float) -> float:
    """`I_x(a, b)` for `a, b > 0`, `0 ≤ x ≤ 1`."""
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"x must lie in [0, 1], got {x}")
    if x in (0.0, 1.0):
        return x
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_continued_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_continued_fraction(b, a, 1.0 - x) / b


def student_t_cdf(t: float, dof: float) -> float:
    if dof <= 0:
        raise ValueError(f"degrees of freedom must be positive, got {dof}")
    tail = 0.5 * regularized_incomplete_beta(dof / 2.0, 0.5, dof / (dof + t * t))
    return 1.0 - tail if t >= 0 else tail


def student_t_quantile(probability: float, dof: float) -> float:
    """The `t` with `P(T ≤ t) = probability` for Student's t with `dof` degrees of freedom."""
    if not 0.0 < probability < 1.0:
        raise ValueError(f"probability must lie in (0, 1), got {probability}")
    if probability < 0.5:
        return -student_t_quantile(1.0 - probability, dof)
    low, high = 0.0, 1.0
    while student_t_cdf(high, dof) < probability:
        high *= 2.0
    for _ in range(200):
        middle = 0.5 * (low + high)
        if student_t_cdf(middle, dof) < probability:
            low = middle
        else:
            high = middle
        if high - low < 1e-12 * max(1.0, high):
            break
    return 0.5 * (low + high)


MIN_SEEDS = 3
"""Seeds per arm below which a difference gets no interval (see the module docstring)."""


@dataclass(frozen=True)
class Interval:
    """A difference (or mean) with its two-sided confidence interval and the test it came from."""

    estimate: float
    low: float | None
    high: float | None
    """None when there is no interval (too few seeds, no spread): `method` says why."""
    method: str
    """'t', 'paired t' or 'Welch t' (with `dof`), else the reason there is no interval."""
    dof: float | None = None
    """Degrees of freedom of the t quantile; None without an interval."""
    seeds: int = 0
    """Seeds per arm the interval rests on (the smaller arm's for Welch's)."""


def mean_interval(values: Sequence[float], confidence: float = 0.95) -> Interval:
    centre = mean(values)
    if len(values) < 2:
        return Interval(centre, None, None, "single value", seeds=len(values))
    dof = len(values) - 1
    half = student_t_quantile(0.5 + confidence / 2, dof) * sample_std(values) / math.sqrt(len(values))
    return Interval(centre, centre - half, centre + half, "t", dof=dof, seeds=len(values))


def too_few_seeds(seeds: int) -> str:
    return f"too few seeds to tell (n={seeds}; need ≥ {MIN_SEEDS})"


def difference_interval(variant: dict[int, float], baseline: dict[int, float], confidence: float = 0.95) -> Interval:
    """`mean(variant) − mean(baseline)` with its interval; both map a seed index to a value.

    Paired when both have the same seeds, Welch's otherwise; no interval under `MIN_SEEDS` seeds
    in either arm."""
    a, b = list(variant.values()), list(baseline.values())
    estimate = mean(a) - mean(b)
    seeds = min(len(a), len(b))
    if seeds < MIN_SEEDS:
        return Interval(estimate, None, None, too_few_seeds(seeds), seeds=seeds)
    method = "Welch t"
    if set(variant) == set(baseline):
        differences = [variant[seed] - baseline[seed] for seed in sorted(variant)]
        paired = mean_interval(differences, confidence)
        if paired.high != paired.low:
            return Interval(estimate, paired.low, paired.high, "paired t", dof=paired.dof, seeds=seeds)
        method = "Welch t (paired differences without spread)"
    va, vb = sample_std(a) ** 2 / len(a), sample_std(b) ** 2 / len(b)
    spread = math.sqrt(va + vb)
    if spread == 0.0:
        return Interval(estimate, None, None, "no spread over seeds: cannot tell", seeds=seeds)
    dof = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    half = student_t_quantile(0.5 + confidence / 2, dof) * spread
    return Interval(estimate, estimate - half, estimate + half, method, dof=dof, seeds=seeds)
