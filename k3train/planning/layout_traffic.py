"""Bytes one rank sends per step and group, for any layout (PP and EP included).

The data-parallel terms are read from the rank's gradient reducer and ZeRO-1 exchanges built on
the meta device (`build_planning_rank`), the pipeline hops from `PipelinePlan.rank_step_bytes`
(the exact-delta block protocol the executor runs) and the expert all-to-alls from
`ExpertParallel.buffer_shapes` (the fixed-size buffers the dispatcher sends). The TP terms follow
`traffic.step_traffic_terms` (regions × N per micro-batch); for `pp = ep = 1` that function is
the exact, measured formula.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from k3train.config import JobConfig
from k3train.parallel.state import Layout
from k3train.parallel.tensor_overlap import chunk_bounds
from k3train.planning.context import context_step_bytes
from k3train.planning.time import TensorOverlap
from k3train.training.build import RankJob


def expert_layer_traffic(
    ep,
    cfg,
    tokens: int,
    activation: int,
    weight: int,
    replica_matrices: int = 0,
    recompute: bool = False,
    gpus_per_node: int = 0,
) -> tuple[tuple[int, int], tuple[int, int] | None]:
    """One MoE layer's expert traffic on one rank, (bytes, messages): per micro-batch of `tokens`
    local tokens (dispatch + combine `[R, C, l]` and their adjoints, the int32 slot ids `[R, C]`,
    and in `balanced` mode the all-gather of the `[1, E]` int64 loads the routing plan is made
    from), and per step in `balanced` mode (None otherwise) the replica weights this rank sends
    out and, at the step's end, their gradients back: two uneven all-to-alls, sent even when
    empty as on the first step, `replica_matrices` expert matrices each way; with `online` replica
    planning instead, per micro-batch, the `[R, M, F]` replica exchange and its adjoint. With `recompute`
    (`recompute: sublayer`) backward reruns the layer's forward, all-to-alls included (the
    replicas are the step's cached ones). Shapes from the dispatcher's own
    `ExpertParallel.buffer_shapes`; the `nodes` transport's rows, expected ones, from
    `node_layer_traffic` (`gpus_per_node`: 0 for `DEFAULT_GPUS_PER_NODE`). With
    `parallel.ep_overlap_halves` each half of the micro-batch's sequences is a dispatcher call of
    its own (its chunks, loads all-gather, `online` replica exchange and top-ups): halves of
    `tokens // 2` and the rest, exact for an even micro-batch size."""
    calls = [tokens // 2, tokens - tokens // 2] if getattr(ep, "overlap_halves", False) else [tokens]
    # `ep_overlap_chunks`: each chunk of a call's tokens has buffers of its own size, one loads all-gather per call
    chunks = [
        end - start
        for call in calls
        for start, end in (chunk_bounds(call, ep.overlap_chunks) if ep.overlaps else [(0, call)])
    ]
    rows = ids = hop_count = 0
    node_bytes = node_messages = 0.0
    for chunk_tokens in chunks:
        shapes = ep.buffer_shapes(
            chunk_tokens, cfg.num_experts_per_token, cfg.routed_expert_hidden_size, cfg.moe_intermediate_size
        )
        if ep.transport == "nodes":  # expected rows, deduplicated per (token, node)
            parts = node_layer_traffic(
                ep, cfg, chunk_tokens, activation, gpus_per_node or DEFAULT_GPUS_PER_NODE, recompute
            )
            node_bytes += sum(nbytes for nbytes, _ in parts.values())
            node_messages += sum(messages for _, messages in parts.values())
            continue
        # The two-hop transports (spread and relay) add `forward [R, C2, l]` and its ids.
        hops = ("dispatch", "forward") if "forward" in shapes else ("dispatch",)
        rows += sum(math.prod(shapes[hop]) for hop in hops) * activation
        ids += sum(math.prod(shapes[f"{hop}_ids"]) for hop in hops) * 4
        hop_count += len(hops)
    forward, forward_messages = 2 * rows + ids, 3 * hop_count  # per hop: rows, their ids, the combine
    if "replica_weights" in shapes:  # the all-gather of the [1, E] int64 loads (of every chunk), once per call
        forward, forward_messages = forward + len(chunks) * cfg.num_experts * 8, forward_messages + len(calls)
    nbytes = (2 if recompute else 1) * forward + 2 * rows  # + the adjoints of dispatch and combine
    messages = (2 if recompute else 1) * forward_messages + 2 * hop_count
    nbytes, messages = int(nbytes + node_bytes), int(messages + node_messages)
    if "replica_weights" not in shapes:
        return (nbytes, messages), None
    if len(shapes["replica_weights"]) == 3:  # `online` replicas: `[R, M, F]` per micro-batch, no step exchange
        exchange = math.prod(shapes["replica_weights"]) * weight
        if ep.transport in ("exact", "nodes"):  # counted: only the replicated matrices, `M` per rank on average
            exchange = math.prod(shapes["replica_weights"][1:]) * weight
        exchanges = len(calls) * ((2 if recompute else 1) + 1)  # each call's, and its adjoint
        return (nbytes + exchanges * exchange, messages + exchanges), None
    matrix = math.prod(shapes["replica_weights"][1:]) * weight
    if "top_up_weights" in shapes:  # `step` placements' top-ups: one exchange and its adjoint per micro-batch
        exchanges = len(calls) * ((2 if recompute else 1) + 1)
        top_up = math.prod(shapes["top_up_weights"]) * weight  # the equal-split `[R, T, F]`
        if ep.transport in ("exact", "nodes"):  # counted: only placed top-ups travel, none while the placement holds
            top_up = 0
        nbytes, messages = nbytes + exchanges * top_up, messages + exchanges
    return (nbytes, messages), (2 * replica_matrices * matrix, 2)


DEFAULT_GPUS_PER_NODE = 8  # every shipped hardware profile (tools/hardware/); `parallel.gpus_per_node` overrides


def node_hit_probability(num_experts: int, top_k: int, nodes: int) -> float:
    """The chance that a token's `top_k` distinct experts, drawn uniformly from `num_experts`
    spread evenly over `nodes`, include at least one on a given node: `1 − C(E − E/n, k) / C(E, k)`."""
    per_node = num_experts // nodes
    return 1.0 - math.comb(num_experts - per_node, top_k) / math.comb(num_experts, top_k)


def node_layer_traffic(
    ep, cfg, tokens: int, activation: int, gpus_per_node: int, recompute: bool = False
) -> dict[str, tuple[float, int]]:
    """Expected `(bytes, messages)` of one MoE layer and micro-batch of `tokens` on one rank with
    the `nodes` transport (`parallel/expert_nodes.py`), under routing spread evenly over the
    experts (the most distinct nodes a token reaches; correlated routing reaches fewer), by label:
    `ep.internode` (per (token, remote node) its row, `2k` int64 choices and `k` fp32 weights;
    back, the gateway's fp32 sum; the adjoints of rows, weights and sums in backward),
    `ep.intranode` (every slot's row and int64 id forwarded inside the node, the expert outputs
    back, and their adjoints), `ep` (the two int64 split-size exchanges of `R` counts). Members
    per node: `min(ep, gpus_per_node)`."""
    size, top_k, width = ep.size, cfg.num_experts_per_token, cfg.expert_width
    members = max(1, min(size, gpus_per_node))
    nodes = max(1, size // members)
    remote_rows = tokens * (nodes - 1) * node_hit_probability(cfg.num_experts, top_k, nodes)
    slots = tokens * top_k  # forwarded inside the node (a gateway holds as many in expectation)
    forwards = 2 if recompute else 1
    internode = remote_rows * (
        forwards * (width * activation + 2 * top_k * 8 + top_k * 4 + width * 4)  # rows, choices, weights; sums back
        + (width * activation + top_k * 4 + width * 4)  # backward: the adjoints of rows, weights and sums
    )
    intranode = slots * (forwards * (width * activation + 8 + width * activation) + 2 * width * activation)
    return {
        "ep.internode": (internode, forwards * 4 + 3),
        "ep.intranode": (intranode, forwards * 3 + 2),
        "ep": (forwards * 2 * size * 8, forwards * 2),
    }


def nodes_intranode_bytes(ep, config: JobConfig, local_tokens: int) -> float:
    """The expected intra-node bytes of one MoE layer and micro-batch with the `nodes` transport
    (`node_layer_traffic`), in the job's activation dtype and recompute setting."""
    cfg = config.model
    activation = 4 if config.train.precision == "fp32" else 2
    gpus_per_node = config.parallel.gpus_per_node or DEFAULT_GPUS_PER_NODE
    traffic = node_layer_traffic(ep, cfg, local_tokens, activation, gpus_per_node, cfg.recompute == "sublayer")
    return traffic["ep.intranode"][0]


def pipeline_expert_traffic(job: RankJob, micro_batches: int, replica_matrices: int = 0) -> dict[str, tuple[int, int]]:
    """Exact (bytes, messages) of one step on this rank for the pipeline hops (`pp.forward`,
    `pp.backward`: one isend per tensor, the exact-delta protocol) and the expert all-to-alls
    (`ep`), in comm.py's convention. Per MoE layer and micro-batch: (balanced) the all-gather of
    the `[1, E]` int64 loads; the dispatch `[R, C, l]`, its ids `[R, C]` int32 and the combine
    `[R, C, l]`, and in backward the adjoints of dispatch and combine. Per step and layer
    (balanced): the replica weights this rank sends and their gradients back, `replica_matrices`
    expert matrices each way; how many depends on the previous step's loads (none on the first
    step, at most `max_replicas` per receiving rank), so the caller says. Replica gradients reach
    the home gradients in backward (either planning), so `expert_dp` carries the home gradients'
    buckets alone (`data_parallel_wire_bytes`, not here). Per step: the expert
    share of the gradient norm (one fp32 scalar). `recompute: sublayer` repeats the forward
    all-to-alls that autograd tracks in backward (not modelled: refused)."""
    config = job.config
    cfg, layout = config.model, job.parallel.layout
    # This rank's tokens of a sequence: seq_length / cp under context parallelism.
    b, s, h, tp = config.train.micro_batch_size, config.data.seq_length // layout.cp, cfg.hidden_size, layout.tp
    sp = config.parallel.sequence_parallel and tp > 1
    out: dict[str, tuple[int, int]] = {}
    if layout.pp > 1:
        element = job.schedule.dtype.itemsize
        tensor_bytes = b * (s // tp if sp else s) * h * element
        rank = job.parallel.pp_rank
        for direction, chunks in (
            ("forward", [c for c in job.plan.chunks_of_rank(rank) if c < job.plan.num_chunks - 1]),
            ("backward", [c - 1 for c in job.plan.chunks_of_rank(rank) if c > 0]),
        ):
            tensors = sum(1 + len(job.plan.hop_blocks(hop)) for hop in chunks) * micro_batches
            if tensors:
                out[f"pp.{direction}"] = (tensors * tensor_bytes, tensors)
    ep = job.expert_parallel
    layers = [i for start, end in job.plan.layer_ranges(job.parallel.pp_rank) for i in range(start, end)]
    moe = sum(cfg.is_moe_layer(i) for i in layers)
    if ep is not None and moe:
        activation = 4 if config.train.precision == "fp32" else 2
        weight = next(job.model.parameters()).element_size()
        per_micro_batch, per_step = expert_layer_traffic(
            ep,
            cfg,
            b * s // (tp if sp else 1),
            activation,
            weight,
            replica_matrices,
            cfg.recompute == "sublayer",
            config.parallel.gpus_per_node,
        )
        out["ep"] = (micro_batches * moe * per_micro_batch[0], micro_batches * moe * per_micro_batch[1])
        if per_step is not None:
            # their gradients return home in the step's last backward, before the gradient
            # reduction: over `expert_dp` only the home gradients' buckets travel
            out[f"{ep.group.name}.replicas"] = (moe * per_step[0], moe * per_step[1])
    if ep is not None:  # the expert share of the global gradient norm: one fp32 scalar (`norm_shares`)
        nbytes, messages = out.get("ep", (0, 0))
        out["ep"] = (nbytes + 4, messages + 1)
        out = dict(sorted(out.items()))
    return out


def data_parallel_wire_bytes(job: RankJob, all_reduced: bool = False, exchange_apart: bool = False) -> dict[str, float]:
    """Per group: bytes this rank puts on the wire per step for the gradient buckets and the
    ZeRO-1 parameter exchange, on a ring (all-reduce 2(p-1)/p of its input, reduce-scatter
    (p-1)/p, all-gather (p-1) × the local chunk), read off the rank's own reducer and optimizer:
    the quantity that ZeRO-1's reduce-scatter to the owners lowers (docs/data_parallel.md).
    `all_reduced`: as if every bucket were all-reduced over its reduction group (ZeRO-1 before
    the reduce-scatter to owners: all-reduce + all-gather). `exchange_apart`: the ZeRO-1 exchange
    under `<group>.exchange` (it runs after the optimizer step, exposed, where the gradient
    buckets overlap the last backward)."""
    out: dict[str, float] = defaultdict(float)
    for bucket in job.reducer.buckets:
        if all_reduced and bucket.sharded:
            p = bucket.reduction.group.size
            element = torch.empty((), dtype=bucket.dtype).element_size()
            out[bucket.reduction.group.name] += 2 * (p - 1) / p * (bucket.numel + len(bucket.params)) * element
            continue
        for group, nbytes in bucket.wire_bytes().items():
            out[group] += nbytes
    for exchange in job.optimizer._exchanges:
        out[exchange.group.name + (".exchange" if exchange_apart else "")] += exchange.wire_bytes()
    return dict(out)


DATA_PARALLEL_GROUPS = ("dp", "data_tensor", "expert_dp")


def gradient_bucket_schedule(job: RankJob, counted: bool = False) -> dict[str, list[tuple[float, float]]]:
    """Per data-parallel group, the rank's gradient buckets in launch order as `(bytes, share of
    the backward done when the bucket is full)`, the share being the bucket's place among all
    buckets' elements (a backward's work taken as proportional to the parameters it has passed):
    what `time.estimate_step_time` replays. Bytes on a ring (`wire_bytes`), or as comm.py counts
    them (`counted`: the emulated link's charge)."""
    buckets = job.reducer.buckets
    total = sum(bucket.numel for bucket in buckets) or 1
    out: dict[str, list[tuple[float, float]]] = defaultdict(list)
    done = 0
    for bucket in buckets:
        done += bucket.numel
        sizes = {group: sent[0] for group, sent in bucket.sent().items()} if counted else bucket.wire_bytes()
        for group, nbytes in sizes.items():
            if group in DATA_PARALLEL_GROUPS and nbytes:
                out[group].append((float(nbytes), done / total))
    return dict(out)


def layout_step_bytes(job: RankJob, micro_batches: int) -> dict[str, float]:
    """Per group: bytes this rank sends (comm.py's convention) in one training step."""
    config = job.config
    cfg, layout = config.model, job.parallel.layout
    element = 2 if config.train.precision != "fp32" else 4  # bf16, and fp8 (bf16 between its FP8 GEMMs)
    b, s, h, tp = config.train.micro_batch_size, config.data.seq_length, cfg.hidden_size, layout.tp
    sp = config.parallel.sequence_parallel and tp > 1
    full = b * s // layout.cp * h * element  # this rank's tokens (s / cp under context parallelism)
    shard = full // tp if sp else full
    out: dict[str, float] = defaultdict(float)
    layers = [i for start, end in job.plan.layer_ranges(job.parallel.pp_rank) for i in range(start, end)]
    moe = sum(cfg.is_moe_layer(i) for i in layers)
    if tp > 1:
        regions = len(layers) + (len(layers) - moe) + (moe if cfg.num_shared_experts else 0)
        out["tp"] += micro_batches * regions * 2 * (full + (shard if sp else 0))
    for bucket in job.reducer.buckets:  # a group of one rank sends nothing (expert_dp when ep = dp × tp)
        for group, (nbytes, _) in bucket.sent().items():
            out[group] += nbytes
    for exchange in job.optimizer._exchanges:
        chunk = max(1, job.optimizer.bucket_bytes // torch.empty((), dtype=exchange.dtype).element_size())
        out[exchange.group.name] += exchange.sent(chunk)[0]
    # Steady state: every rank receives its full `max_replicas` (spare slots are filled).
    replicas = job.expert_parallel.max_replicas if job.expert_parallel is not None else 0
    for group, (nbytes, _) in pipeline_expert_traffic(job, micro_batches, replicas).items():
        out[group.split(".")[0]] += nbytes
    ep = job.expert_parallel
    if ep is not None and ep.transport == "nodes":  # its forwards stay inside the node (NVLink)
        local_tokens = b * s // layout.cp // (tp if sp else 1)
        intranode = micro_batches * moe * nodes_intranode_bytes(ep, config, local_tokens)
        out["ep"] -= intranode
        out["ep.intranode"] = intranode
    if layout.cp > 1:  # context parallelism's exchanges (k3train/planning/context.py)
        out["cp"] += context_step_bytes(
            cfg,
            layers,
            cp=layout.cp,
            tp=tp,
            micro_batch_size=b,
            seq_length=s,
            micro_batches=micro_batches,
            element_bytes=element,
        )
    return dict(out)


def overlapped_tensor_regions(config: JobConfig, layout: Layout, device_type: str = "cuda") -> TensorOverlap | None:
    """The overlapped TP regions (every mixer and MLP region's entry, and its leave unless
    `model.recompute=sublayer`) of one step (`parallel.tp_overlap_chunks`,
    `parallel/tensor_overlap.py`), as `estimate_step_time` prices them; None when none overlap:
    tp 1, `tp_overlap_chunks` 0, or projections that are not plain torch linears. On CUDA
    `model.linear_backend: auto` picks Transformer Engine's (the planner takes it to import
    there), whose regions do not overlap, so only `torch` overlaps; on a CPU every backend is torch."""
    chunks, tp = config.parallel.tp_overlap_chunks, layout.tp
    if tp == 1 or chunks == 0 or (device_type == "cuda" and config.model.linear_backend != "torch"):
        return None
    element = 2 if config.train.precision != "fp32" else 4  # as layout_step_bytes
    tokens = config.train.micro_batch_size * config.data.seq_length // layout.cp
    full = tokens * config.model.hidden_size * element
    leaves = config.model.recompute != "sublayer"
    if config.parallel.sequence_parallel:  # the all-gather of N/tp in pieces, the gradient's reduce-scatter of N
        pieces = len(chunk_bounds(config.data.seq_length // (layout.cp * tp), chunks))
        return TensorOverlap(
            gather_bytes=full // tp,
            reduce_bytes=full,
            pieces=pieces,
            leave_reduce_bytes=full if leaves else 0,
            leave_gather_bytes=full // tp if leaves else 0,
            leave_pieces=pieces if leaves else 0,
        )
    # entry: one all-reduce in backward; leave: the forward all-reduce in pieces of the sequence
    leave_pieces = len(chunk_bounds(tokens // config.train.micro_batch_size, chunks)) if leaves else 0
    return TensorOverlap(
        gather_bytes=0, reduce_bytes=full, pieces=1, leave_reduce_bytes=full if leaves else 0, leave_pieces=leave_pieces
    )


__all__ = [
    "DEFAULT_GPUS_PER_NODE",
    "node_hit_probability",
    "node_layer_traffic",
    "nodes_intranode_bytes",
    "overlapped_tensor_regions",
    "gradient_bucket_schedule",
    "DATA_PARALLEL_GROUPS",
    "layout_step_bytes",
    "pipeline_expert_traffic",
    "data_parallel_wire_bytes",
    "expert_layer_traffic",
]
