"""Search the layouts of a world size: every (tp, pp, virtual stages, ep, dp, recompute,
micro-batch size) the recipe accepts, ranked by predicted step time among those that fit memory.

A candidate is accepted only if the job's own checks pass (`load_config` with the overrides,
`resolve_layout`, `PipelinePlan.from_config`, the interleaved schedule's micro-batch rule and the
expert dispatcher's SP rule). Its memory and time are estimated analytically (parameters per
stage from `model/flops.py`'s closed forms, the same activation and time models as the planner),
so thousands of candidates cost seconds; `tools/plan.py` then builds the chosen one exactly.

What the layouts share (rank-0 states, dispatchers, stage parameters, chunk activations) is
computed once (`search_cache.SearchCache`); a layout whose weights, gradients and optimizer state
alone exceed the limit is dropped before its activations or time are priced, and so are the
other micro-batch sizes and dispatch modes of the same (tp, pp, v, ep); the step time is priced
only for layouts that fit. A `SearchBudget` bounds the wall time and draws the progress bar.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from k3train.config import ConfigError, JobConfig, apply_overrides, load_config
from k3train.model import flops as F
from k3train.model.config import ModelConfig
from k3train.parallel.config import divisors
from k3train.parallel.pipeline_schedule import PipelineConfigError, PipelinePlan, check_interleaved_micro_batches
from k3train.parallel.state import Layout, LayoutError, layout_of
from k3train.planning.hardware import HardwareProfile
from k3train.planning.layout_traffic import expert_layer_traffic, nodes_intranode_bytes, overlapped_tensor_regions
from k3train.planning.memory import GIB, activation_shape, expert_layer_buffer_bytes, peak_in_flight
from k3train.planning.search_budget import SearchBudget
from k3train.planning.search_cache import SearchCache
from k3train.planning.stage_parameters import stage_parameters
from k3train.planning.time import StepTime, estimate_step_time

RECOMPUTE: tuple[Literal["none", "attn_res", "sublayer"], ...] = ("none", "attn_res", "sublayer")


@dataclass(frozen=True)
class Candidate:
    """One layout that the recipe accepts, with its estimates."""

    tp: int
    pp: int
    virtual_stages: int
    ep: int
    dp: int  # `parallel.dp`: the batch shards (each holds `cp` replicas of the weights)
    cp: int  # the recipe's context-parallel size, which the search keeps
    recompute: str
    micro_batch_size: int
    expert_dispatch: str
    memory_gib: float  # the fullest pipeline rank
    time: StepTime

    def overrides(self, keep_pipeline_layers: bool = False) -> list[str]:
        """Recipe overrides that select this layout (`pretrain_k3.py ... <overrides>`)."""
        out = [
            f"parallel.tp={self.tp}",
            f"parallel.pp={self.pp}",
            f"parallel.dp={self.dp}",
            f"parallel.cp={self.cp}",
            f"parallel.ep={self.ep}",
            f"parallel.virtual_stages={self.virtual_stages}",
            f"model.recompute={self.recompute}",
            f"train.micro_batch_size={self.micro_batch_size}",
            f"parallel.expert_dispatch={self.expert_dispatch}",
        ]
        if self.tp > 1 and self.ep > 1:
            out.append("parallel.sequence_parallel=true")
        if not keep_pipeline_layers:
            out.append("parallel.pipeline_layers=null")
        return out


def data_parallel_wire(
    cfg: ModelConfig,
    layout: Layout,
    plan: PipelinePlan,
    cache: SearchCache | None = None,
    gradient_bytes: int = 4,
    weight_bytes: int = 4,
) -> dict[str, float]:
    """Ring wire bytes per step of the fullest stage's gradient reduction (`gradient_bytes` per
    element) and ZeRO-1 exchange (`weight_bytes`), as `layout_traffic.data_parallel_wire_bytes` counts them on a built rank, without
    padding: dense parameters over `dp` (with or without ZeRO-1: an all-reduce, or the reduce-
    scatter to the owners plus the all-gather, both 2(p−1)/p of the gradients), routed experts
    over `expert_dp` (dp·tp/ep ranks). `tests/unit/test_plan_search.py` holds it to the built
    rank's bytes."""
    cache = cache or SearchCache()
    out: dict[str, float] = {}
    expert_dp = layout.dp * layout.tp // layout.ep
    dense = experts = 0.0
    for rank in range(layout.pp):
        ranges = plan.layer_ranges(rank)
        params, _ = cache.stage_parameters(cfg, ranges, layout.tp, layout.ep)
        moe = sum(cfg.is_moe_layer(i) for start, end in ranges for i in range(start, end))
        # Without EP the experts are ordinary replicated weights, reduced over dp with the rest.
        routed = moe * F.routed_experts_parameters(cfg, cfg.num_experts) / layout.ep if layout.ep > 1 else 0.0
        if params - routed > dense:
            dense, experts = params - routed, routed
    element = gradient_bytes + weight_bytes  # (p−1)/p of each: the reduce-scatter and the all-gather
    if layout.dp > 1:
        out["dp"] = (layout.dp - 1) / layout.dp * dense * element
    if expert_dp > 1 and experts:
        out["expert_dp"] = (expert_dp - 1) / expert_dp * experts * element
    return out


def accepted(
    base: JobConfig, overrides: list[str], world_size: int, cache: SearchCache | None = None
) -> tuple[JobConfig, Layout, PipelinePlan] | None:
    """The job's own checks; None when any refuses the layout."""
    cache = cache or SearchCache()
    try:
        config = apply_overrides(base, overrides)  # the recipe's own validation, parsed once
        p, m = config.parallel, config.model
        layout = layout_of(world_size, p, m)
        plan = PipelinePlan.from_config(m, p)
        micro_batches = config.train.micro_batches_per_rank(layout.data_parallel)
        if layout.virtual_stages > 1:
            check_interleaved_micro_batches(layout.pp, micro_batches)
        cache.expert_parallel(layout, p, m.num_experts)  # the dispatcher's EP/SP rule
    except (ConfigError, LayoutError, PipelineConfigError, ValueError):
        return None
    return config, layout, plan


def analytic_step_bytes(
    config: JobConfig, layout: Layout, plan: PipelinePlan, cache: SearchCache | None = None
) -> dict[str, float]:
    """Per group, what the busiest rank sends in one step, without building it: the TP regions
    (`traffic.py`'s regions × N per micro-batch), the data-parallel ring bytes without padding
    (`data_parallel_wire`), the pipeline hops of pipeline rank 1 (`PipelinePlan.rank_step_bytes`,
    the exact-delta protocol) and the expert traffic of the rank with the most MoE layers from the
    dispatcher's own buffer shapes (`layout_traffic.expert_layer_traffic`, steady state: every
    replica slot filled). `tests/unit/test_plan_search.py` holds each to the built rank's bytes."""
    cache = cache or SearchCache()
    cfg, train = config.model, config.train
    micro_batches = train.micro_batches_per_rank(layout.data_parallel)
    element = 2 if train.precision != "fp32" else 4  # bf16, and fp8 (bf16 between its FP8 GEMMs)
    sp = config.parallel.sequence_parallel and layout.tp > 1
    tokens = train.micro_batch_size * config.data.seq_length // layout.cp  # a rank's share of each sequence
    full = tokens * cfg.hidden_size * element
    ranks = [[i for start, end in plan.layer_ranges(rank) for i in range(start, end)] for rank in range(layout.pp)]
    comm: dict[str, float] = {}
    if layout.tp > 1:
        layers = max(ranks, key=len)  # traffic.py's regions: mixer, dense MLP or shared experts
        moe = sum(cfg.is_moe_layer(i) for i in layers)
        regions = len(layers) + (len(layers) - moe) + (moe if cfg.num_shared_experts else 0)
        comm["tp"] = micro_batches * regions * 2 * (full + (full / layout.tp if sp else 0))
    gradient = 2 if train.grad_dtype == "bf16" else 4
    wire = data_parallel_wire(cfg, layout, plan, cache, gradient, weight_bytes(config))
    if config.parallel.zero1:  # the all-gather of the updated weights runs after the step, exposed
        share = weight_bytes(config) / (gradient + weight_bytes(config))
        for group, nbytes in wire.items():
            comm[group], comm[f"{group}.exchange"] = nbytes * (1 - share), nbytes * share
    else:
        comm.update(wire)
    if layout.pp > 1:  # the schedule's wire dtype: the model's (bf16 weights), else fp32
        block = tokens * cfg.hidden_size * weight_bytes(config) // (layout.tp if sp else 1)
        comm["pp"] = sum(plan.rank_step_bytes(1 % layout.pp, int(block), micro_batches).values())
    if layout.ep > 1:
        moe = max(sum(cfg.is_moe_layer(i) for i in layers) for layers in ranks)
        ep = cache.expert_parallel(layout, config.parallel, cfg.num_experts)
        assert ep is not None  # ep > 1 always has a dispatcher
        local_tokens = tokens // (layout.tp if sp else 1)
        per_micro_batch, per_step = expert_layer_traffic(
            ep,
            cfg,
            local_tokens,
            element,
            weight_bytes(config),
            ep.max_replicas,
            cfg.recompute == "sublayer",
            config.parallel.gpus_per_node,
        )
        # + the expert share of the global gradient norm (one fp32 scalar).
        comm["ep"] = moe * (micro_batches * per_micro_batch[0] + (per_step[0] if per_step else 0)) + 4
        if ep.transport == "nodes":  # its forwards stay inside the node (NVLink)
            comm["ep.intranode"] = micro_batches * moe * nodes_intranode_bytes(ep, config, local_tokens)
            comm["ep"] -= comm["ep.intranode"]
    return comm


def weight_bytes(config: JobConfig) -> int:
    """Bytes of one model weight element (and of the pipeline's wire and the expert replicas)."""
    return 2 if config.train.weights == "bf16_with_fp32_master_shards" else 4


def static_memory_gib(config: JobConfig, layout: Layout, plan: PipelinePlan, cache: SearchCache | None = None) -> float:
    """GiB of the fullest rank's weights, gradients and optimizer state: a lower bound of
    `estimate_memory` whatever the micro-batch size, dispatch mode or recompute setting."""
    cache = cache or SearchCache()
    return max(_static_bytes(config, layout, plan.layer_ranges(rank), cache) for rank in range(layout.pp)) / GIB


def _static_bytes(config: JobConfig, layout: Layout, ranges: list[tuple[int, int]], cache: SearchCache) -> float:
    params, state = cache.stage_parameters(config.model, ranges, layout.tp, layout.ep)
    shards = 1
    if config.parallel.zero1:
        expert_dp = layout.dp * layout.tp // layout.ep
        shards = min(layout.dp, expert_dp) if layout.ep > 1 else layout.dp
    gradient = 2 if config.train.grad_dtype == "bf16" else 4
    if config.train.weights == "bf16_with_fp32_master_shards":
        # bf16 weights, the persistent gradient buffers, fp32 masters and state of the owned share
        return params * (2 + gradient) + (params + state) * 4 / shards
    # fp32 weights and p.grad, the bucket buffers of the reduction (about the gradients again
    # when anything is reduced), fp32 state of the owned share
    buckets = params * gradient if layout.dp > 1 or layout.tp > 1 else 0.0
    return params * 8 + buckets + state * 4 / shards


def estimate_memory(config: JobConfig, layout: Layout, plan: PipelinePlan, cache: SearchCache | None = None) -> float:
    """GiB of the fullest pipeline rank of an accepted layout, analytically."""
    cache = cache or SearchCache()
    cfg, train = config.model, config.train
    micro_batches = train.micro_batches_per_rank(layout.data_parallel)
    element = 2 if train.precision != "fp32" else 4  # bf16, and fp8 (bf16 between its FP8 GEMMs)
    sp = config.parallel.sequence_parallel and layout.tp > 1
    shape = activation_shape(
        config, train.micro_batch_size * config.data.seq_length // layout.cp, layout.tp, sp, layout.ep
    )
    expert_buffers = replica_weights = 0.0  # per MoE layer in flight; per MoE layer held
    if layout.ep > 1:  # as memory.py: dispatch and combine of every MoE layer in flight, replicas per layer
        ep = cache.expert_parallel(layout, config.parallel, cfg.num_experts)
        assert ep is not None  # ep > 1 always has a dispatcher
        expert_buffers = expert_layer_buffer_bytes(ep, cfg, int(shape.outside_tokens), element)
        shapes = ep.buffer_shapes(1, cfg.num_experts_per_token, cfg.expert_width, cfg.moe_intermediate_size)
        exchange = 0.0  # `online` replicas: the [R, M, F] buffer of the layer fetching now
        if "replica_weights" in shapes and ep.max_replicas:
            if len(shapes["replica_weights"]) == 3:  # as memory.py: [M, F] held per layer, one exchange
                exchange = math.prod(shapes["replica_weights"]) * weight_bytes(config)
                replica_weights = math.prod(shapes["replica_weights"][1:]) * weight_bytes(config)
            else:
                replica_weights = 2 * math.prod(shapes["replica_weights"]) * weight_bytes(config)
    worst = 0.0
    for rank in range(layout.pp):
        ranges = plan.layer_ranges(rank)
        in_flight = peak_in_flight(plan, rank, micro_batches)
        activations = sum(
            n * cache.chunk_activation_bytes(cfg, r, shape, config.data.seq_length) for n, r in zip(in_flight, ranges)
        )
        if train.offload_activations:  # as memory.py: one micro-batch of the largest chunk on the device
            activations = max(cache.chunk_activation_bytes(cfg, r, shape, config.data.seq_length) for r in ranges)
        if layout.pp > 1:  # the AttnRes blocks the pipeline cache holds
            activations += (
                cache.peak_blocks(plan, rank, micro_batches) * shape.outside_tokens * cfg.hidden_size * element
            )
        if layout.ep > 1:
            moe_live = sum(n * sum(cfg.is_moe_layer(i) for i in range(*r)) for n, r in zip(in_flight, ranges))
            activations += moe_live * expert_buffers
            if replica_weights:
                moe_here = sum(cfg.is_moe_layer(i) for r in ranges for i in range(*r))
                activations += moe_here * replica_weights + (exchange if moe_here else 0.0)
        worst = max(worst, _static_bytes(config, layout, ranges, cache) + activations)
    return worst / GIB


def estimate_time(
    config: JobConfig,
    layout: Layout,
    plan: PipelinePlan,
    hardware: HardwareProfile,
    efficiency: float,
    cache: SearchCache | None = None,
) -> StepTime:
    """The step time of an accepted layout from its analytic bytes per group."""
    cfg, train = config.model, config.train
    comm = analytic_step_bytes(config, layout, plan, cache)
    return estimate_step_time(
        cfg,
        layout,
        plan,
        hardware,
        micro_batch_size=train.micro_batch_size,
        seq_length=config.data.seq_length,
        micro_batches=train.micro_batches_per_rank(layout.data_parallel),
        precision=train.precision,
        comm_bytes=comm,
        efficiency=efficiency,
        ep_overlap_chunks=config.parallel.ep_overlap_chunks,
        ep_overlap_halves=config.parallel.ep_overlap_halves,
        tp_overlap=overlapped_tensor_regions(config, layout),
    )


def estimate(
    config: JobConfig,
    layout: Layout,
    plan: PipelinePlan,
    hardware: HardwareProfile,
    efficiency: float,
    cache: SearchCache | None = None,
) -> tuple[float, StepTime]:
    """(GiB of the fullest pipeline rank, step time) of an accepted layout, analytically."""
    cache = cache or SearchCache()
    return (
        estimate_memory(config, layout, plan, cache),
        estimate_time(config, layout, plan, hardware, efficiency, cache),
    )


@dataclass(frozen=True)
class LayoutOption:
    """One (tp, pp, dp, ep, virtual stages, micro-batch size, dispatch) to try; each is priced
    under every recompute setting."""

    tp: int
    pp: int
    dp: int  # `parallel.dp`: the batch shards
    cp: int
    ep: int
    virtual_stages: int
    micro_batch_size: int
    expert_dispatch: str

    def overrides(self) -> list[str]:
        out = [
            f"parallel.tp={self.tp}",
            f"parallel.pp={self.pp}",
            f"parallel.dp={self.dp}",
            f"parallel.cp={self.cp}",
            f"parallel.ep={self.ep}",
            f"parallel.virtual_stages={self.virtual_stages}",
            f"train.micro_batch_size={self.micro_batch_size}",
            "parallel.pipeline_layers=null",
            f"parallel.expert_dispatch={self.expert_dispatch}",
        ]
        if self.tp > 1 and self.ep > 1:
            out.append("parallel.sequence_parallel=true")
        return out


@dataclass(frozen=True)
class SearchOutcome:
    """The fastest fitting layouts of one world size, and how much of the space was priced."""

    world_size: int
    candidates: tuple[Candidate, ...]
    layouts: int  # every option × recompute setting of this world size
    evaluated: int  # checked and priced, or dropped by a check or the memory bound
    out_of_budget: bool  # stopped by the budget (not by `first_fit`)

    @property
    def unevaluated(self) -> int:
        return self.layouts - self.evaluated


@dataclass(frozen=True)
class LayoutScreen:
    """What `LayoutSearch.screen` found for one (tp, pp, v, ep) of a world size."""

    refused: bool  # by `resolve_layout` or the pipeline partition
    static_gib: float  # the fullest rank's weights, gradients and optimizer state

    def could_fit(self, limit_gib: float) -> bool:
        return not self.refused and self.static_gib <= limit_gib


@dataclass(frozen=True)
class NearestSizes:
    """World sizes near a refused one that have a fitting layout, nearest first then sorted."""

    sizes: tuple[int, ...]
    out_of_budget: bool  # the budget ran out before `count` sizes were found


class LayoutSearch:
    """The searches of one recipe on one hardware profile; every world size searched through one
    instance shares its cache and its budget."""

    def __init__(
        self,
        recipe: str,
        hardware: HardwareProfile,
        *,
        memory_limit_gib: float | None = None,
        gpus_per_node: int | None = None,
        efficiency: float = 0.45,
        overrides: Sequence[str] = (),
        micro_batch_sizes: Sequence[int] = (1, 2),
        budget: SearchBudget | None = None,
    ):
        self.base = load_config(recipe, list(overrides))
        self.hardware = hardware
        self.limit_gib = memory_limit_gib if memory_limit_gib is not None else hardware.memory_limit_gib()
        self.gpus_per_node = gpus_per_node or hardware.gpus_per_node
        self.efficiency = efficiency
        self.micro_batch_sizes = tuple(micro_batch_sizes)
        self.budget = budget or SearchBudget()
        self.cache = SearchCache()

    def options(self, world_size: int) -> list[LayoutOption]:
        """`tp` dividing the node, `pp` up to the layers, the recipe's `cp`, `dp` the rest, `ep` 1
        and the three largest divisors of the stage's dp·cp·tp ranks that divide the experts, v 1
        or 2, each micro-batch size and dispatch mode (one dispatch when ep = 1: there is no
        dispatcher). `cp` is kept: the recipe sets it for its sequence length."""
        cfg = self.base.model
        cp = self.base.parallel.cp
        out: list[LayoutOption] = []
        for tp in [t for t in divisors(self.gpus_per_node) if world_size % t == 0]:
            for pp in [p for p in divisors(world_size // tp) if p <= cfg.num_hidden_layers]:
                if world_size % (tp * pp * cp):
                    continue
                dp = world_size // (tp * pp * cp)
                eps = [e for e in divisors(dp * cp * tp) if cfg.num_experts == 0 or cfg.num_experts % e == 0]
                eps = sorted(set([1, *eps[-3:]])) if cfg.num_experts else [1]
                for ep, v, mbs, dispatch in itertools.product(
                    eps, (1, 2) if pp > 1 else (1,), self.micro_batch_sizes, ("balanced", "capacity")
                ):
                    if ep == 1 and dispatch != self.base.parallel.expert_dispatch:
                        continue
                    out.append(LayoutOption(tp, pp, dp, cp, ep, v, mbs, dispatch))
        return out

    def screen(self, world_size: int, option: LayoutOption) -> LayoutScreen:
        """The checks and the memory bound that do not depend on the micro-batch size, the
        dispatch mode or the recompute setting, from the recipe as loaded: `resolve_layout` and
        `PipelinePlan.build` (which `accepted` runs too, after the slower override parsing), and
        the fullest rank's weights, gradients and optimizer state."""
        cfg = self.base.model
        try:
            layout = layout_of(world_size, option, cfg)
            plan = PipelinePlan.build(
                cfg.num_hidden_layers, option.pp, option.virtual_stages, cfg.attn_res, cfg.attn_res_block_size, None
            )  # as `parallel.pipeline_layers=null`
        except (LayoutError, PipelineConfigError, ValueError):  # what `accepted` treats as a refusal
            return LayoutScreen(refused=True, static_gib=0.0)
        return LayoutScreen(refused=False, static_gib=static_memory_gib(self.base, layout, plan, self.cache))

    def run(self, world_size: int, top: int = 5, first_fit: bool = False) -> SearchOutcome:
        """The `top` fastest accepted layouts of `world_size` that fit (with `first_fit`, the
        first one found), until the budget runs out."""
        options = self.options(world_size)
        layouts = len(options) * len(RECOMPUTE)
        found: list[Candidate] = []
        screens: dict[tuple[int, int, int, int], LayoutScreen] = {}  # per (tp, pp, v, ep): one plan, one weight set
        evaluated = 0
        out_of_budget = False
        bar = self.budget.progress(
            layouts, f"world {world_size}" + (" (any fit?)" if first_fit else ""), keep=not first_fit
        )
        try:
            for option in options:
                if self.budget.expired():
                    out_of_budget = True
                    break
                evaluated += len(RECOMPUTE)
                bar.update(len(RECOMPUTE))
                group = (option.tp, option.pp, option.virtual_stages, option.ep)
                if group not in screens:
                    screens[group] = self.screen(world_size, option)
                if not screens[group].could_fit(self.limit_gib):
                    continue  # refused, or the weights alone do not fit: no need to parse or price it
                checked = accepted(self.base, option.overrides(), world_size, self.cache)
                if checked is None:
                    continue
                config, layout, plan = checked
                for recompute in RECOMPUTE:  # any recompute setting runs with any layout
                    config = dataclasses.replace(config, model=dataclasses.replace(config.model, recompute=recompute))
                    memory = estimate_memory(config, layout, plan, self.cache)
                    if memory > self.limit_gib:
                        continue
                    time = estimate_time(config, layout, plan, self.hardware, self.efficiency, self.cache)
                    found.append(
                        Candidate(
                            option.tp,
                            option.pp,
                            option.virtual_stages,
                            option.ep,
                            option.dp,
                            option.cp,
                            recompute,
                            option.micro_batch_size,
                            option.expert_dispatch,
                            memory,
                            time,
                        )
                    )
                    if first_fit:
                        return SearchOutcome(world_size, tuple(found), layouts, evaluated, False)
        finally:
            bar.close()
        found.sort(key=lambda c: (round(c.time.step_s, 6), c.memory_gib))
        return SearchOutcome(world_size, tuple(found[:top]), layouts, evaluated, out_of_budget)

    def nearest_fitting_world_sizes(self, world_size: int, count: int = 2, step: int = 8) -> NearestSizes:
        """World sizes (multiples of `step`, nearest first) where a layout fits, until the budget
        runs out."""
        sizes: list[int] = []
        below = world_size // step * step
        above = below + step
        while len(sizes) < count and (below > 0 or above < 4 * world_size):
            for size in (below, above):
                if self.budget.expired():
                    return NearestSizes(tuple(sorted(sizes)[:count]), True)
                if 0 < size != world_size and size not in sizes and self.run(size, first_fit=True).candidates:
                    sizes.append(size)
            below, above = below - step, above + step
        return NearestSizes(tuple(sorted(sizes)[:count]), False)


def search_layouts(
    recipe: str,
    world_size: int,
    hardware: HardwareProfile,
    *,
    memory_limit_gib: float | None = None,
    gpus_per_node: int | None = None,
    efficiency: float = 0.45,
    overrides: Sequence[str] = (),
    top: int = 5,
    micro_batch_sizes: Sequence[int] = (1, 2),
    first_fit: bool = False,
) -> list[Candidate]:
    """The `top` fastest accepted layouts of `world_size` whose fullest rank fits `memory_limit_gib`
    (default: the hardware's memory less 10% for the allocator and the framework)."""
    search = LayoutSearch(
        recipe,
        hardware,
        memory_limit_gib=memory_limit_gib,
        gpus_per_node=gpus_per_node,
        efficiency=efficiency,
        overrides=overrides,
        micro_batch_sizes=micro_batch_sizes,
    )
    return list(search.run(world_size, top=top, first_fit=first_fit).candidates)


def nearest_fitting_world_sizes(
    recipe: str, world_size: int, hardware: HardwareProfile, *, count: int = 2, step: int = 8, **kwargs
) -> list[int]:
    """World sizes (multiples of `step`, nearest first) where `search_layouts` finds a layout."""
    return list(LayoutSearch(recipe, hardware, **kwargs).nearest_fitting_world_sizes(world_size, count, step).sizes)


__all__ = [
    "Candidate",
    "LayoutOption",
    "LayoutScreen",
    "LayoutSearch",
    "NearestSizes",
    "SearchOutcome",
    "search_layouts",
    "nearest_fitting_world_sizes",
    "stage_parameters",
    "accepted",
    "data_parallel_wire",
    "analytic_step_bytes",
    "static_memory_gib",
    "estimate_memory",
    "estimate_time",
    "estimate",
    "describe_candidates",
]


def describe_candidates(candidates: list[Candidate]) -> str:
    """The table `tools/plan.py --search` prints (markdown)."""
    lines = [
        "| tp | pp | v | ep | dispatch | cp | dp | recompute | mbs | GiB (fullest rank) | step s | tokens/s | MFU "
        "| bubble | exposed comm |",
        "| ---: | ---: | ---: | ---: | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for c in candidates:
        t = c.time
        dispatch = c.expert_dispatch if c.ep > 1 else "-"
        lines.append(
            f"| {c.tp} | {c.pp} | {c.virtual_stages} | {c.ep} | {dispatch} | {c.cp} | {c.dp} | {c.recompute} | {c.micro_batch_size} "
            f"| {c.memory_gib:,.1f} | {t.step_s:,.2f} | {t.tokens_per_s:,.0f} | {t.mfu:.1%} "
            f"| {t.shares()['bubble']:.0%} | {sum(t.exposed_comm_s.values()) / t.step_s:.0%} |"
        )
    return "\n".join(lines)
