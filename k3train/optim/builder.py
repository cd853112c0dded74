"""Which parameter gets which optimizer, the optimizer built from `OptimizerConfig`, and the
start-up table that shows the routing.

Routing (docs/design.md §1.6): a parameter with two or more dimensions that is not marked
`adamw_only` gets Muon (2-D matrices, per-head projections, `[experts, out, in]` stacks);
everything else gets AdamW: embedding, output head and AttnRes queries (marked `adamw_only`),
norms, biases, KDA `A_log`/`dt_bias` and every other vector. AdamW weight decay applies to its
2-D+ parameters only, never to vectors.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import torch
from torch import nn

from k3train.contracts.param_roles import is_adamw_only
from k3train.optim.config import OptimizerConfig
from k3train.optim.muon import PerHeadMuon, block_layout, fused_adamw_supported

Route = Literal["muon", "adamw", "adamw_no_decay"]

# Display order and label of each route in the start-up table.
_ROUTE_LABELS: dict[str, str] = {"muon": "Muon", "adamw": "AdamW", "adamw_no_decay": "AdamW wd=0"}


@dataclass(frozen=True)
class ParamRoute:
    """One trainable parameter, the optimizer route it takes and why."""

    name: str
    param: nn.Parameter = field(compare=False, repr=False)
    route: Route
    reason: str


def route_parameters(model: nn.Module, config: OptimizerConfig) -> list[ParamRoute]:
    """Route every trainable parameter of `model` (shared parameters once, in module order)."""
    routes = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if param.ndim < 2:
            routes.append(ParamRoute(name, param, "adamw_no_decay", f"{param.ndim}-D"))
        elif config.name == "adamw":
            routes.append(ParamRoute(name, param, "adamw", "name=adamw"))
        elif is_adamw_only(param):
            routes.append(ParamRoute(name, param, "adamw", "adamw_only"))
        else:
            routes.append(ParamRoute(name, param, "muon", "matrix"))
    return routes


class ParameterCost(NamedTuple):
    """What stepping one parameter costs the optimizer (ZeRO-1 balances owners by it)."""

    muon: bool
    """Routed to Muon (else AdamW)."""
    cost: int
    """Muon: the Newton–Schulz cost of its blocks (`BlockLayout.cost`); AdamW: its element count."""


def parameter_costs(model: nn.Module, config: OptimizerConfig) -> dict[str, ParameterCost]:
    """The optimizer cost of each trainable parameter, by name (in module order): what the
    ZeRO-1 wrapper needs to plan owners without knowing how parameters are routed."""
    costs = {}
    for route in route_parameters(model, config):
        if route.route == "muon":
            costs[route.name] = ParameterCost(True, block_layout(route.param, config.muon_per_head).cost)
        else:
            costs[route.name] = ParameterCost(False, route.param.numel())
    return costs


def param_groups(model: nn.Module, config: OptimizerConfig) -> list[dict]:
    """Optimizer param groups (named parameters, so the state dict carries `param_names`).

    At most three groups, in the order muon, adamw (with weight decay), adamw_no_decay; a group
    with no parameters is left out. Each group's `role` key names it for logs.
    """
    by_route: dict[str, list[tuple[str, nn.Parameter]]] = defaultdict(list)
    for r in route_parameters(model, config):
        by_route[r.route].append((r.name, r.param))
    overrides: dict[str, dict[str, object]] = {
        "muon": {"algorithm": "muon"},
        "adamw": {"algorithm": "adamw"},
        "adamw_no_decay": {"algorithm": "adamw", "weight_decay": 0.0},
    }
    return [
        {"params": by_route[route], "role": route, **overrides[route]} for route in _ROUTE_LABELS if by_route[route]
    ]


def build_optimizer(model: nn.Module, config: OptimizerConfig) -> torch.optim.Optimizer:
    """The one optimizer the training loop steps.

    `config.name == "muon"`: a `PerHeadMuon` whose Muon group holds the matrices and whose AdamW
    groups hold the rest. `"adamw"`: a plain `torch.optim.AdamW` with the same decay/no-decay
    split. Either way a scheduler sets the lr by writing `group["lr"]` in every param group
    (Muon's update is RMS-matched to AdamW's, so both kinds share one lr).
    """
    groups = param_groups(model, config)
    betas = (config.adam_beta1, config.adam_beta2)
    if config.name == "adamw":
        for group in groups:
            group.pop("algorithm")
        return torch.optim.AdamW(
            groups,
            lr=config.lr,
            betas=betas,
            eps=config.adam_eps,
            weight_decay=config.weight_decay,
            fused=config.adamw_fused and fused_adamw_supported(p for group in groups for _, p in group["params"]),
        )
    if config.name != "muon":
        raise ValueError(f"unknown optimizer {config.name!r} (muon or adamw)")
    return PerHeadMuon(
        groups,
        lr=config.lr,
        weight_decay=config.weight_decay,
        momentum=config.muon_momentum,
        nesterov=config.muon_nesterov,
        ns_steps=config.muon_ns_steps,
        ns_eps=config.muon_ns_eps,
        update_rms=config.muon_update_rms,
        per_head=config.muon_per_head,
        ns_dtype=config.newton_schulz_dtype,
        betas=betas,
        adam_eps=config.adam_eps,
        fused=config.adamw_fused,
    )


def name_pattern(name: str) -> str:
    """`layers.3.mlp.experts.7.w1` -> `layers.*.mlp.experts.*.w1` (group layers in tables)."""
    return re.sub(r"(^|\.)\d+(?=\.|$)", r"\1*", name)


def _count(n: int) -> str:
    """Compact element count: 950, 12.3K, 4.56M, 1.02B."""
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def _routing_rows(model: nn.Module, config: OptimizerConfig) -> dict[tuple[str, str], _TableRow]:
    """One row per (route, name pattern): tensor count, elements and the block layouts (Muon) or
    shapes and reason (AdamW)."""
    rows: dict[tuple[str, str], _TableRow] = {}
    for r in route_parameters(model, config):
        row = rows.setdefault((r.route, name_pattern(r.name)), _TableRow())
        row.tensors += 1
        row.numel += r.param.numel()
        if r.route == "muon":
            row.details[block_layout(r.param, config.muon_per_head).describe()] = None
        else:
            row.details[f"[{','.join(map(str, r.param.shape))}] {r.reason}"] = None
    return rows


def summarize_param_groups(model: nn.Module, config: OptimizerConfig) -> str:
    """The optimizer's settings and one line per route (Muon, AdamW, AdamW without decay): its
    groups of parameters (name patterns, layers collapsed), tensors and parameters. What the job
    prints at start-up; `describe_param_groups` is the full table (`logging.optimizer_table`)."""
    rows = _routing_rows(model, config)
    totals = {route: [0, 0, 0] for route in _ROUTE_LABELS}  # groups, tensors, elements
    for (route, _), row in rows.items():
        totals[route][0] += 1
        totals[route][1] += row.tensors
        totals[route][2] += row.numel
    all_numel = sum(numel for _, _, numel in totals.values()) or 1
    shown = [(route, counts) for route, counts in totals.items() if counts[1]]
    label_width = max(len(_ROUTE_LABELS[route]) for route, _ in shown) if shown else 0
    lines = [_header(config)]
    for route, (groups, tensors, numel) in shown:
        lines.append(
            f"  {_ROUTE_LABELS[route]:<{label_width}}  {groups:>3} group{'s' if groups != 1 else ' '} "
            f"{tensors:>5} tensors {_count(numel):>7} parameters ({100 * numel / all_numel:.1f}%)"
        )
    lines.append("  (logging.optimizer_table=true prints every group)")
    return "\n".join(lines)


def describe_param_groups(model: nn.Module, config: OptimizerConfig) -> str:
    """A compact table of the routing: one row per (route, name pattern) with tensor count,
    elements and, for Muon, the block layout (e.g. `per-head 4×[32,128]`), for AdamW the
    shapes and the reason. Printed by the training job at start-up with `logging.optimizer_table`."""
    rows = _routing_rows(model, config)
    table = [("optimizer", "parameters", "tensors", "elements", "blocks / shape")]
    totals = {route: _TableRow() for route in _ROUTE_LABELS}
    for route in _ROUTE_LABELS:  # Muon rows first, then AdamW, then AdamW without decay
        for (row_route, pattern), row in rows.items():
            if row_route == route:
                label, count = _ROUTE_LABELS[route], str(row.tensors)
                table.append((label, pattern, count, _count(row.numel), row.shown()))
                totals[route].tensors += row.tensors
                totals[route].numel += row.numel

    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]) - 1)]
    lines = [_header(config)]
    for line in table:
        cells = [
            cell.rjust(width) if column in (2, 3) else cell.ljust(width)  # numbers right-aligned
            for column, (cell, width) in enumerate(zip(line, widths))
        ]
        lines.append("  " + "  ".join(cells + [line[-1]]))
    all_numel = sum(t.numel for t in totals.values()) or 1
    summary = [
        f"{_ROUTE_LABELS[route]} {t.tensors} tensors, {_count(t.numel)} ({100 * t.numel / all_numel:.1f}%)"
        for route, t in totals.items()
        if t.tensors
    ]
    lines.append("  total: " + "; ".join(summary))
    return "\n".join(lines)


@dataclass
class _TableRow:
    """Accumulator for one row of `describe_param_groups`."""

    tensors: int = 0
    numel: int = 0
    details: dict[str, None] = field(default_factory=dict)
    """Distinct block layouts / shapes, in first-seen order (a dict as an ordered set)."""

    def shown(self, limit: int = 3) -> str:
        more = len(self.details) - limit
        return ", ".join(list(self.details)[:limit]) + (f", +{more} more" if more > 0 else "")


def _header(config: OptimizerConfig) -> str:
    """One line with the optimizer's settings."""
    adamw = f"AdamW betas=({config.adam_beta1}, {config.adam_beta2}) eps={config.adam_eps}"
    common = f"lr={config.lr:g} weight_decay={config.weight_decay:g}"
    if config.name == "adamw":
        return f"optimizer: {adamw}, {common}"
    nesterov = "nesterov " if config.muon_nesterov else ""
    per_head = "Per-Head Muon" if config.muon_per_head else "Muon (whole matrices)"
    return (
        f"optimizer: {per_head} ({nesterov}momentum={config.muon_momentum} "
        f"ns_steps={config.muon_ns_steps} update_rms={config.muon_update_rms}) + {adamw}, {common}"
    )
