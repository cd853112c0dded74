"""Routing-bias balancers (docs/design.md §1.5): Quantile Balancing, exact and by histogram, and the sign update.

A balancer watches the router during a step's forward passes (`observe`) and, after the
optimizer step, returns the bias for the *next* step (`next_bias`); the batch that produced the
statistics is never routed with the bias computed from it.

Quantile Balancing, per expert j: with `α_i` the (k+1)-th largest biased score of token i and
`r_ij = α_i − s_ij`, expert j is chosen for token i exactly when `b_j > r_ij`. The bias that lets
`q = m·k/n` of the m tokens through is the `k/n` quantile of `r_{:,j}` (docs/design.md §1.5 writes the same as
`−quantile_{1−k/n}(s − α)`), recentred to mean zero. The histogram form counts `r` into fixed bins
over `[min b − 1, max b + 1]` (every `r` lands there because `s ∈ [0, 1]`), so a step's counts add
up across micro-batches and ranks with one all-reduce, and its quantile is off by at most a bin.
"""

from __future__ import annotations

import torch

from k3train.model.config import ModelConfig


class Balancer:
    """Interface: `observe(scores, bias)` in forward, `next_bias(bias)` once per step.

    Statistics that combine over ranks by summation (`summable_statistics`) can be pooled for
    every layer at once by `k3train.model.moe.pool_routing_statistics` (one all-reduce per step);
    `pooled` then tells `next_bias` not to reduce them again.
    """

    pooled = False
    uses_cutoff = False  # whether `observe` reads `α` (the router can pass it from its own top-k)

    def summable_statistics(self) -> list[torch.Tensor]:
        """The step's statistics that ranks combine by an elementwise sum (reduced in place)."""
        return []

    def observe(self, scores: torch.Tensor, bias: torch.Tensor, cutoff: torch.Tensor | None = None) -> None:
        """`scores [tokens, experts]` raw sigmoid scores (fp32); `bias` the bias used for this step;
        `cutoff [tokens]`: `kth_largest_cutoff(scores, bias, k)` where the caller has it already
        (computed here when None)."""

    def next_bias(self, bias: torch.Tensor, group=None) -> torch.Tensor:
        """The bias for the next step; resets the statistics. `group` (a `k3train.parallel.comm.Group`
        or None) holds every rank that routed distinct tokens: statistics are combined over it."""
        return bias


def kth_largest_cutoff(scores: torch.Tensor, bias: torch.Tensor, top_k: int) -> torch.Tensor:
    """`α_i`: the (k+1)-th largest biased score of each token, `[tokens]`."""
    return (scores + bias).topk(top_k + 1, dim=-1).values[:, -1]


class ExactQuantileBalancer(Balancer):
    """Keeps every margin of the step and takes `torch.quantile` (single process, tests, ablations)."""

    def __init__(self, num_experts: int, top_k: int):
        self.num_experts, self.top_k = num_experts, top_k
        self.margins: list[torch.Tensor] = []

    uses_cutoff = True

    def observe(self, scores, bias, cutoff=None):
        if cutoff is None:
            cutoff = kth_largest_cutoff(scores, bias, self.top_k)
        self.margins.append(cutoff[:, None] - scores)

    def next_bias(self, bias, group=None):
        if not self.margins:
            return bias
        margins = torch.cat(self.margins)
        self.margins = []
        if group is not None:
            margins = group.all_gather(margins, dim=0)
        new_bias = torch.quantile(margins.double(), self.top_k / self.num_experts, dim=0).to(bias.dtype)
        return new_bias - new_bias.mean()


class HistogramQuantileBalancer(Balancer):
    """Counts margins into `bins` bins per expert; the counts are what ranks all-reduce."""

    def __init__(self, num_experts: int, top_k: int, bins: int):
        self.num_experts, self.top_k, self.bins = num_experts, top_k, bins
        self.counts: torch.Tensor | None = None  # [experts, bins] int64, summed over the step
        self.range: tuple[float, float] | None = None

    @staticmethod
    def margin_range(bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return bias.min() - 1.0, bias.max() + 1.0

    uses_cutoff = True

    def observe(self, scores, bias, cutoff=None):
        low, high = self.margin_range(bias)
        if cutoff is None:
            cutoff = kth_largest_cutoff(scores, bias, self.top_k)
        margins = cutoff[:, None] - scores
        bin_index = ((margins - low) / (high - low) * self.bins).long().clamp_(0, self.bins - 1)
        flat = (bin_index + torch.arange(self.num_experts, device=scores.device) * self.bins).flatten()
        counts = torch.bincount(flat, minlength=self.num_experts * self.bins).view(self.num_experts, self.bins)
        self.counts = counts if self.counts is None else self.counts + counts

    def summable_statistics(self):
        return [] if self.counts is None else [self.counts]

    def next_bias(self, bias, group=None):
        if self.counts is None:
            return bias
        counts, self.counts = self.counts, None
        if group is not None and not self.pooled:
            group.all_reduce(counts)  # one all-reduce of experts × bins integers
        self.pooled = False
        new_bias = histogram_quantile(counts, self.top_k / self.num_experts, *self.margin_range(bias))
        new_bias = new_bias.to(bias.dtype)
        return new_bias - new_bias.mean()


def histogram_quantile(counts: torch.Tensor, level: float, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """Per row, the value below which a `level` fraction of the counted samples lie.

    Reads the cumulative counts and interpolates linearly inside the bin where they cross
    the target, so the error against the exact quantile is at most one bin width.
    """
    bins = counts.shape[-1]
    counts = counts.double()
    cumulative = counts.cumsum(-1)
    target = cumulative[:, -1:] * level
    crossing_bin = torch.searchsorted(cumulative, target).clamp_(max=bins - 1)  # first bin with cdf ≥ target
    before = torch.where(
        crossing_bin > 0, cumulative.gather(-1, (crossing_bin - 1).clamp(min=0)), torch.zeros_like(target)
    )
    in_bin = counts.gather(-1, crossing_bin).clamp(min=1.0)
    fraction = ((target - before) / in_bin).clamp(0.0, 1.0)
    width = (high - low).double() / bins
    return (low.double() + (crossing_bin.double() + fraction) * width).squeeze(-1)


class SignBalancer(Balancer):
    """DeepSeek's aux-loss-free update: `b += rate · sign(mean load − load)`, recentred."""

    def __init__(self, num_experts: int, top_k: int, rate: float):
        self.num_experts, self.top_k, self.rate = num_experts, top_k, rate
        self.loads: torch.Tensor | None = None

    def observe(self, scores, bias, cutoff=None):
        chosen = (scores + bias).topk(self.top_k, dim=-1).indices.flatten()
        loads = torch.bincount(chosen, minlength=self.num_experts)
        self.loads = loads if self.loads is None else self.loads + loads

    def summable_statistics(self):
        return [] if self.loads is None else [self.loads]

    def next_bias(self, bias, group=None):
        if self.loads is None:
            return bias
        loads, self.loads = self.loads, None
        if group is not None and not self.pooled:
            group.all_reduce(loads)
        self.pooled = False
        loads = loads.to(bias.dtype)
        delta = self.rate * torch.sign(loads.mean() - loads)
        return bias + delta - delta.mean()


def build_balancer(config: ModelConfig) -> Balancer:
    n, k = config.num_experts, config.num_experts_per_token
    if config.balancer == "quantile":
        return ExactQuantileBalancer(n, k)
    if config.balancer == "quantile_histogram":
        return HistogramQuantileBalancer(n, k, config.balancer_bins)
    if config.balancer == "sign":
        return SignBalancer(n, k, config.balancer_sign_rate)
    return Balancer()
