"""Loss-against-compute fits of a ladder, and the compute multiplier between two arms.

Per arm, `L(C) = a · C^(−b)` (optionally `+ E`, an irreducible loss) is fitted to the points
(training FLOPs, final loss) of its sizes. Without `E` this is a straight line in log–log space
fitted by least squares; with `E` the line is fitted to `log(L − E)` for each `E` on a grid below
the smallest loss and the `E` of the smallest squared error in `log L` is kept (a one-parameter
search over a convex-looking profile: enough for a handful of points, no optimiser needed).

The compute multiplier of arm A over the baseline at loss `L` is `C_base(L) / C_A(L)`: how many
times the compute the baseline needs to reach the loss A reaches with `C_A(L)` (the form of the
AttnRes paper's "1.25× compute advantage"). With equal exponents it does not depend on `L`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PowerLaw:
    """`loss = irreducible + a · compute^(−b)`."""

    a: float
    b: float
    irreducible: float = 0.0
    residual: float = 0.0
    """Root-mean-square error of the fit in log loss."""

    def loss(self, compute: float) -> float:
        return self.irreducible + self.a * compute ** (-self.b)

    def compute_for(self, loss: float) -> float | None:
        """The compute that reaches `loss`; None at or below the irreducible loss or for b ≤ 0."""
        if loss <= self.irreducible or self.b <= 0:
            return None
        return ((loss - self.irreducible) / self.a) ** (-1.0 / self.b)


def _line_fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares `y = intercept + slope · x`."""
    n = len(xs)
    mx, my = math.fsum(xs) / n, math.fsum(ys) / n
    sxx = math.fsum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("a power-law fit needs at least two different compute values")
    slope = math.fsum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - slope * mx, slope


def fit_power_law(
    compute: Sequence[float], loss: Sequence[float], irreducible: bool = False, grid_points: int = 400
) -> PowerLaw:
    """Fit `loss ≈ E + a·C^(−b)` to the points; `E = 0` unless `irreducible` (which needs three
    points or more: two determine a line exactly for every E)."""
    if len(compute) != len(loss) or len(compute) < 2:
        raise ValueError(f"a power-law fit needs at least two (compute, loss) points, got {len(compute)}")
    if any(c <= 0 for c in compute) or any(v <= 0 for v in loss):
        raise ValueError("compute and loss must be positive for a power-law fit")
    log_c = [math.log(c) for c in compute]

    def fit_with(e: float) -> PowerLaw:
        intercept, slope = _line_fit(log_c, [math.log(v - e) for v in loss])
        law = PowerLaw(a=math.exp(intercept), b=-slope, irreducible=e)
        errors = [math.log(law.loss(c)) - math.log(v) for c, v in zip(compute, loss)]
        return PowerLaw(law.a, law.b, e, math.sqrt(math.fsum(x * x for x in errors) / len(errors)))

    if not irreducible:
        return fit_with(0.0)
    if len(compute) < 3:
        raise ValueError("a fit with an irreducible loss needs at least three sizes")
    floor = min(loss)
    candidates = [fit_with(floor * i / grid_points) for i in range(grid_points)]
    return min(candidates, key=lambda law: law.residual)


def compute_multiplier(arm: PowerLaw, baseline: PowerLaw, loss: float) -> float | None:
    """`C_baseline(loss) / C_arm(loss)`: > 1 means the arm needs less compute for that loss."""
    base, other = baseline.compute_for(loss), arm.compute_for(loss)
    if base is None or other is None:
        return None
    return base / other
