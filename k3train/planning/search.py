"""Search the layouts of a world size: every (tp, pp, virtual stages, ep, dp, recompute,
micro-batch size) the recipe accepts, ranked by predicted step time among those that fit memory.

A candidate is accepted only if the job's own checks pass (`load_config` with the overrides,
`resolve_layout`, `PipelinePlan.from_config`, the interleaved schedule's micro-batch rule and the
expert dispatcher's SP rule). Its memory and time are estimated analytically (parameters per
stage from `model/flops.py`'s closed forms, the same activation and time models as the planner),
so thousands of candidates cost seconds; `tools/plan.py` then builds the chosen one exactly.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from dataclasses import dataclass
from typing import Optional, Sequence

from k3train.config import ConfigError, JobConfig, apply_overrides, load_config
from k3train.model import flops as F
from k3train.model.config import ModelConfig
from k3train.parallel.expert import ExpertParallel
from k3train.parallel.pipeline import theoretical_peak_blocks
from k3train.parallel.pipeline_schedule import PipelineConfigError, PipelinePlan, check_interleaved_micro_batches
from k3train.parallel.state import Layout, LayoutError, resolve_layout
from k3train.planning.hardware import HardwareProfile
from k3train.planning.layout_traffic import expert_layer_traffic
from k3train.planning.memory import GIB, ActivationShape, chunk_activation_bytes, peak_in_flight
from k3train.planning.time import StepTime, estimate_step_time
from k3train.training.build import planning_parallel_state

RECOMPUTE = ("none", "attn_res", "sublayer")


@dataclass(frozen=True)
class Candidate:
    """One layout that the recipe accepts, with its estimates."""

    tp: int
    pp: int
    virtual_stages: int
    ep: int
    dp: int
    recompute: str
    micro_batch_size: int
    expert_dispatch: str
    memory_gib: float  # the fullest pipeline rank
    time: StepTime

    def overrides(self, keep_pipeline_layers: bool = False) -> list[str]:
        """Recipe overrides that select this layout (`pretrain_k3.py ... <overrides>`)."""
        out = [f"parallel.tp={self.tp}", f"parallel.pp={self.pp}", f"parallel.dp={self.dp}",
               f"parallel.ep={self.ep}", f"parallel.virtual_stages={self.virtual_stages}",
               f"model.recompute={self.recompute}", f"train.micro_batch_size={self.micro_batch_size}",
               f"parallel.expert_dispatch={self.expert_dispatch}"]
        if self.tp > 1 and self.ep > 1:
            out.append("parallel.sequence_parallel=true")
        if not keep_pipeline_layers:
            out.append("parallel.pipeline_layers=null")
        return out


@functools.lru_cache(maxsize=8192)
def _peak_blocks(plan: PipelinePlan, rank: int, micro_batches: int) -> int:
    return theoretical_peak_blocks(plan, rank, micro_batches)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def stage_parameters(cfg: ModelConfig, layer_ranges: Sequence[tuple[int, int]], tp: int, ep: int) -> tuple[float, float]:
    """(parameters, optimizer state elements) of one pipeline rank, from the closed forms:
    mixers, MLPs and shared experts split over TP, routed experts over EP, embedding and head over
    TP (AdamW: two moments), everything else replicated (Muon: one momentum)."""
    params = state = 0.0
    for start, end in layer_ranges:
        for layer in range(start, end):
            mixer = F.mla_mixer_parameters(cfg) if cfg.is_mla_layer(layer) else F.kda_mixer_parameters(cfg)
            if cfg.is_moe_layer(layer):
                ffn = (F.shared_experts_parameters(cfg) / tp + F.routed_experts_parameters(cfg, cfg.num_experts) / ep
                       + F.latent_projection_parameters(cfg) + F.router_parameters(cfg))
            else:
                ffn = F.glu_mlp_parameters(cfg.hidden_size, cfg.intermediate_size) / tp
            layer_params = mixer / tp + ffn + 6 * cfg.hidden_size
            params += layer_params
            state += layer_params
        ends = (start == 0) + (end == cfg.num_hidden_layers)
        params += ends * cfg.vocab_size * cfg.hidden_size / tp
        state += ends * 2 * cfg.vocab_size * cfg.hidden_size / tp
    return params, state


def data_parallel_wire(cfg: ModelConfig, layout: Layout, plan: PipelinePlan) -> dict[str, float]:
    """Ring wire bytes per step of the fullest stage's fp32 gradient reduction and ZeRO-1
    exchange, as `layout_traffic.data_parallel_wire_bytes` counts them on a built rank, without
    padding: dense parameters over `dp` (with or without ZeRO-1: an all-reduce, or the reduce-
    scatter to the owners plus the all-gather, both 2(p−1)/p of the gradients), routed experts
    over `expert_dp` (dp·tp/ep ranks). `tests/unit/test_plan_search.py` holds it to the built
    rank's bytes."""
    out: dict[str, float] = {}
    expert_dp = layout.dp * layout.tp // layout.ep
    dense = experts = 0.0
    for rank in range(layout.pp):
        ranges = plan.layer_ranges(rank)
        params, _ = stage_parameters(cfg, ranges, layout.tp, layout.ep)
        moe = sum(cfg.is_moe_layer(i) for start, end in ranges for i in range(start, end))
        # Without EP the experts are ordinary replicated weights, reduced over dp with the rest.
        routed = moe * F.routed_experts_parameters(cfg, cfg.num_experts) / layout.ep if layout.ep > 1 else 0.0
        if params - routed > dense:
            dense, experts = params - routed, routed
    if layout.dp > 1:
        out["dp"] = 2 * (layout.dp - 1) / layout.dp * dense * 4
    if expert_dp > 1 and experts:
        out["expert_dp"] = 2 * (expert_dp - 1) / expert_dp * experts * 4
    return out


def accepted(base: JobConfig, overrides: list[str], world_size: int) -> Optional[tuple[JobConfig, Layout, PipelinePlan]]:
    """The job's own checks; None when any refuses the layout."""
    try:
        config = apply_overrides(base, overrides)  # the recipe's own validation, parsed once
        p, m = config.parallel, config.model
        layout = resolve_layout(world_size, p.tp, p.pp, p.dp, p.ep, p.virtual_stages, m.num_attention_heads,
                                m.linear_attn_config.num_heads, m.vocab_size, m.num_experts, m.num_hidden_layers)
        plan = PipelinePlan.from_config(m, p)
        micro_batches = config.train.micro_batches_per_rank(layout.dp)
        if layout.virtual_stages > 1:
            check_interleaved_micro_batches(layout.pp, micro_batches)
        ExpertParallel.from_state(planning_parallel_state(layout, 0, p.sequence_parallel), p, m.num_experts)
    except (ConfigError, LayoutError, PipelineConfigError, ValueError):
        return None
    return config, layout, plan


def analytic_step_bytes(config: JobConfig, layout: Layout, plan: PipelinePlan) -> dict[str, float]:
    """Per group, what the busiest rank sends in one step, without building it: the TP regions
    (`traffic.py`'s regions × N per micro-batch), the data-parallel ring bytes without padding
    (`data_parallel_wire`), the pipeline hops of pipeline rank 1 (`PipelinePlan.rank_step_bytes`,
    the exact-delta protocol) and the expert traffic of the rank with the most MoE layers from the
    dispatcher's own buffer shapes (`layout_traffic.expert_layer_traffic`, steady state: every
    replica slot filled). `tests/unit/test_plan_search.py` holds each to the built rank's bytes."""
    cfg, train = config.model, config.train
    micro_batches = train.micro_batches_per_rank(layout.dp)
    element = 2 if train.precision != "fp32" else 4  # bf16, and fp8 (bf16 between its FP8 GEMMs)
    sp = config.parallel.sequence_parallel and layout.tp > 1
    tokens = train.micro_batch_size * config.data.seq_length
    full = tokens * cfg.hidden_size * element
    ranks = [[i for start, end in plan.layer_ranges(rank) for i in range(start, end)] for rank in range(layout.pp)]
    comm: dict[str, float] = {}
    if layout.tp > 1:
        layers = max(ranks, key=len)  # traffic.py's regions: mixer, dense MLP or shared experts
        moe = sum(cfg.is_moe_layer(i) for i in layers)
        regions = len(layers) + (len(layers) - moe) + (moe if cfg.num_shared_experts else 0)
        comm["tp"] = micro_batches * regions * 2 * (full + (full / layout.tp if sp else 0))
    comm.update(data_parallel_wire(cfg, layout, plan))
    if layout.pp > 1:  # the schedule's wire dtype is fp32 whatever the compute precision
        block = tokens * cfg.hidden_size * 4 // (layout.tp if sp else 1)
        comm["pp"] = sum(plan.rank_step_bytes(1 % layout.pp, int(block), micro_batches).values())
    if layout.ep > 1:
        moe = max(sum(cfg.is_moe_layer(i) for i in layers) for layers in ranks)
        ep = ExpertParallel.from_state(planning_parallel_state(layout, 0, config.parallel.sequence_parallel),
                                       config.parallel, cfg.num_experts)
        local_tokens = tokens // (layout.tp if sp else 1)
        per_micro_batch, per_step = expert_layer_traffic(ep, cfg, local_tokens, element, 4, ep.max_replicas,
                                                         cfg.recompute == "sublayer")
        # + the expert share of the global gradient norm (one fp32 scalar).
        comm["ep"] = moe * (micro_batches * per_micro_batch[0] + (per_step[0] if per_step else 0)) + 4
    return comm


def estimate(config: JobConfig, layout: Layout, plan: PipelinePlan, hardware: HardwareProfile,
             efficiency: float) -> tuple[float, StepTime]:
    """(GiB of the fullest pipeline rank, step time) of an accepted layout, analytically."""
    cfg, train = config.model, config.train
    micro_batches = train.micro_batches_per_rank(layout.dp)
    element = 2 if train.precision != "fp32" else 4  # bf16, and fp8 (bf16 between its FP8 GEMMs)
    sp = config.parallel.sequence_parallel and layout.tp > 1
    shape = ActivationShape(train.micro_batch_size * config.data.seq_length, layout.tp, sp, element)
    expert_dp = layout.dp * layout.tp // layout.ep
    worst = 0.0
    for rank in range(layout.pp):
        ranges = plan.layer_ranges(rank)
        params, state = stage_parameters(cfg, ranges, layout.tp, layout.ep)
        if config.parallel.zero1:
            state /= min(layout.dp, expert_dp) if layout.ep > 1 else layout.dp
        in_flight = peak_in_flight(plan, rank, micro_batches)
        activations = sum(n * chunk_activation_bytes(cfg, r, shape, config.data.seq_length)
                          for n, r in zip(in_flight, ranges))
        if layout.pp > 1:  # the AttnRes blocks the pipeline cache holds
            activations += (_peak_blocks(plan, rank, micro_batches) * shape.outside_tokens
                            * cfg.hidden_size * element)
        if layout.ep > 1:  # as memory.py: dispatch and combine of every MoE layer in flight, replicas per layer
            ep = ExpertParallel.from_state(planning_parallel_state(layout, 0, config.parallel.sequence_parallel),
                                           config.parallel, cfg.num_experts)
            shapes = ep.buffer_shapes(int(shape.outside_tokens), cfg.num_experts_per_token,
                                      cfg.routed_expert_hidden_size, cfg.moe_intermediate_size)
            moe_live = sum(n * sum(cfg.is_moe_layer(i) for i in range(*r)) for n, r in zip(in_flight, ranges))
            activations += moe_live * (math.prod(shapes["dispatch"]) + math.prod(shapes["combine"])) * element
            if "replica_weights" in shapes and ep.max_replicas:
                moe_here = sum(cfg.is_moe_layer(i) for r in ranges for i in range(*r))
                activations += moe_here * 2 * math.prod(shapes["replica_weights"]) * 4
        worst = max(worst, params * 8 + state * 4 + activations)
    comm = analytic_step_bytes(config, layout, plan)
    time = estimate_step_time(cfg, layout, plan, hardware, micro_batch_size=train.micro_batch_size,
                              seq_length=config.data.seq_length, micro_batches=micro_batches,
                              precision=train.precision, comm_bytes=comm, efficiency=efficiency)
    return worst / GIB, time


def search_layouts(recipe: str, world_size: int, hardware: HardwareProfile, *, memory_limit_gib: Optional[float] = None,
                   gpus_per_node: Optional[int] = None, efficiency: float = 0.45, overrides: Sequence[str] = (),
                   top: int = 5, micro_batch_sizes: Sequence[int] = (1, 2), first_fit: bool = False) -> list[Candidate]:
    """The `top` fastest accepted layouts of `world_size` whose fullest rank fits `memory_limit_gib`
    (default: the hardware's memory less 10% for the allocator and the framework)."""
    base = load_config(recipe, list(overrides))
    cfg = base.model
    limit = memory_limit_gib if memory_limit_gib is not None else hardware.memory_gib * 0.9 * 1e9 / GIB
    gpn = gpus_per_node or hardware.gpus_per_node
    found: list[Candidate] = []
    for tp in [t for t in _divisors(gpn) if world_size % t == 0]:
        for pp in [p for p in _divisors(world_size // tp) if p <= cfg.num_hidden_layers]:
            dp = world_size // (tp * pp)
            eps = [e for e in _divisors(dp * tp) if cfg.num_experts == 0 or cfg.num_experts % e == 0]
            eps = sorted(set([1, *eps[-3:]])) if cfg.num_experts else [1]
            for ep, v, mbs, dispatch in itertools.product(eps, (1, 2) if pp > 1 else (1,), micro_batch_sizes,
                                                          ("balanced", "capacity")):
                if ep == 1 and dispatch != base.parallel.expert_dispatch:
                    continue  # no dispatcher without expert parallelism
                candidate_overrides = [f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.dp={dp}",
                                       f"parallel.ep={ep}", f"parallel.virtual_stages={v}",
                                       f"train.micro_batch_size={mbs}", "parallel.pipeline_layers=null",
                                       f"parallel.expert_dispatch={dispatch}"]
                if tp > 1 and ep > 1:
                    candidate_overrides.append("parallel.sequence_parallel=true")
                checked = accepted(base, candidate_overrides, world_size)
                if checked is None:
                    continue
                config, layout, plan = checked
                for recompute in RECOMPUTE:  # any recompute setting runs with any layout
                    config = dataclasses.replace(config, model=dataclasses.replace(config.model, recompute=recompute))
                    memory, time = estimate(config, layout, plan, hardware, efficiency)
                    if memory <= limit:
                        found.append(Candidate(tp, pp, v, ep, dp, recompute, mbs, dispatch, memory, time))
                        if first_fit:
                            return found
    found.sort(key=lambda c: (round(c.time.step_s, 6), c.memory_gib))
    return found[:top]


def nearest_fitting_world_sizes(recipe: str, world_size: int, hardware: HardwareProfile, *, count: int = 2,
                                step: int = 8, **kwargs) -> list[int]:
    """World sizes (multiples of `step`, nearest first) where `search_layouts` finds a layout."""
    sizes: list[int] = []
    below = world_size // step * step
    above = below + step
    while len(sizes) < count and (below > 0 or above < 4 * world_size):
        for size in (below, above):
            if 0 < size != world_size and size not in sizes and search_layouts(recipe, size, hardware, first_fit=True,
                                                                       **kwargs):
                sizes.append(size)
        below, above = below - step, above + step
    return sorted(sizes)[:count]


__all__ = ["Candidate", "search_layouts", "nearest_fitting_world_sizes", "stage_parameters", "accepted",
           "data_parallel_wire", "analytic_step_bytes",
           "describe_candidates"]


def describe_candidates(candidates: list[Candidate]) -> str:
    """The table `tools/plan.py --search` prints (markdown)."""
    lines = ["| tp | pp | v | ep | dispatch | dp | recompute | mbs | GiB (fullest rank) | step s | tokens/s | MFU "
             "| bubble | exposed comm |",
             "| ---: | ---: | ---: | ---: | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for c in candidates:
        t = c.time
        dispatch = c.expert_dispatch if c.ep > 1 else "-"
        lines.append(f"| {c.tp} | {c.pp} | {c.virtual_stages} | {c.ep} | {dispatch} | {c.dp} | {c.recompute} | {c.micro_batch_size} "
                     f"| {c.memory_gib:,.1f} | {t.step_s:,.2f} | {t.tokens_per_s:,.0f} | {t.mfu:.1%} "
                     f"| {t.shares()['bubble']:.0%} | {sum(t.exposed_comm_s.values()) / t.step_s:.0%} |")
    return "\n".join(lines)
