"""Predicted communication of one training step: bytes and messages per group, for one rank.

`predicted_step_traffic` is the formula that `benchmarks/comm.py` and `tools/plan.py` print and
that `tests/distributed/test_comm_traffic.py` holds equal to what `parallel/comm.py`'s
`TrafficCounter` measures (`pp = 1`, `ep = 1`). Every term, its notation and its assumptions are
described in `docs/traffic.md`. The model, reducer and optimizer whose layout it reads are built
on the meta device by `k3train/training/build.py`, as the job builds them.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import nn

from k3train.config import JobConfig
from k3train.model.mlp import GLUMLP
from k3train.model.moe import LatentMoE
from k3train.optim.builder import route_parameters
from k3train.optim.muon import block_layout
from k3train.parallel.config import ModelSplitSizes
from k3train.parallel.grad_reduce import DEFAULT_BUCKET_BYTES, is_tensor_parallel
from k3train.parallel.state import resolve_layout
from k3train.parallel.tensor_overlap import chunk_bounds
from k3train.planning.layout_traffic import pipeline_expert_traffic
from k3train.training.build import RankJob, build_planning_rank


@dataclass(frozen=True)
class TrafficTerm:
    """One line of the formula: what one rank sends on `group` in one step."""

    group: str
    what: str
    bytes: int
    messages: int


def _planning_job(
    model_config,
    optimizer_config,
    tp: int,
    dp: int,
    zero1: bool,
    sequence_parallel: bool,
    micro_batch_size: int,
    seq_length: int,
    tp_rank: int,
    dp_rank: int,
    bucket_bytes: int,
    param_dtype: torch.dtype,
    tp_overlap_chunks: int = 0,
) -> RankJob:
    """Rank `(tp_rank, dp_rank)` of a `tp × dp` job built on the meta device as the job builds it;
    the layout is checked as at start-up (`resolve_layout`)."""
    layout = resolve_layout(tp * dp, tp, 1, dp, 1, 1, ModelSplitSizes.of(model_config))
    if not (0 <= tp_rank < tp and 0 <= dp_rank < dp):
        raise ValueError(f"rank (tp {tp_rank}, dp {dp_rank}) outside tp={tp} × dp={dp}")
    base = JobConfig()
    config = dataclasses.replace(
        base,
        model=model_config,
        optimizer=optimizer_config,
        parallel=dataclasses.replace(
            base.parallel,
            tp=tp,
            dp=dp,
            zero1=zero1,
            sequence_parallel=sequence_parallel,
            tp_overlap_chunks=tp_overlap_chunks,
        ),
        train=dataclasses.replace(base.train, micro_batch_size=micro_batch_size),
        data=dataclasses.replace(base.data, seq_length=seq_length),
    )
    return build_planning_rank(
        config, layout, layout.rank_of(tp_rank, dp_rank, 0), bucket_bytes=bucket_bytes, dtype=param_dtype
    )


def step_traffic_terms(
    model_config,
    optimizer_config,
    *,
    tp: int = 1,
    dp: int = 1,
    pp: int = 1,
    ep: int = 1,
    micro_batch_size: int,
    seq_length: int,
    micro_batches: int,
    dtype_bytes: int = 4,
    zero1: bool = True,
    sequence_parallel: bool = False,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    tp_rank: int = 0,
    dp_rank: int = 0,
    param_dtype: torch.dtype = torch.float32,
    tp_overlap_chunks: int = 0,
) -> list[TrafficTerm]:
    """Every term of one training step on rank `(tp_rank, dp_rank)`, in `docs/traffic.md`'s
    order (terms that send nothing are left out). `micro_batches` is per rank and step
    (`global_batch_size / (micro_batch_size · dp)`); `dtype_bytes` the activation element size."""
    if pp != 1 or ep != 1:
        raise ValueError(
            f"step_traffic_terms covers pp=1 and ep=1 (got pp={pp}, ep={ep}); for any layout "
            "build the rank (build_planning_rank) and call job_traffic_terms"
        )
    sp = sequence_parallel and tp > 1
    if sp and seq_length % tp:
        raise ValueError(f"seq_length={seq_length} does not split over tp={tp} (sequence parallelism)")
    job = _planning_job(
        model_config,
        optimizer_config,
        tp,
        dp,
        zero1,
        sp,
        micro_batch_size,
        seq_length,
        tp_rank,
        dp_rank,
        bucket_bytes,
        param_dtype,
        tp_overlap_chunks,
    )
    return job_traffic_terms(job, micro_batches, dtype_bytes)


def overlapped_entry_pieces(job: RankJob, local_sequence: int) -> int:
    """Pieces of a sequence shard of `local_sequence` tokens the job's overlapped TP entries (every
    mixer and MLP region) gather in (1 when they do not overlap: `parallel.tp_overlap_chunks` 0,
    or projections that are not plain torch linears, e.g. Transformer Engine's)."""
    chunks = job.parallel.tp_overlap_chunks
    plain = all(
        type(m.gate_proj) is nn.Linear and m.gate_proj.bias is None
        for m in job.model.modules()
        if isinstance(m, GLUMLP)
    )
    return len(chunk_bounds(local_sequence, chunks)) if chunks > 0 and plain else 1


def overlapped_leave_pieces(job: RankJob, sequence: int) -> int:
    """Pieces of `sequence` tokens (the shard under SP, else the rank's whole sequence) the job's
    overlapped TP leaves (every mixer and MLP region's row-parallel projection) reduce in: as
    `overlapped_entry_pieces`, and 1 under `model.recompute=sublayer`, whose leaves stay unfused."""
    if job.config.model.recompute == "sublayer":
        return 1
    return overlapped_entry_pieces(job, sequence)


def job_traffic_terms(
    job: RankJob, micro_batches: int, dtype_bytes: int = 4, replica_matrices: int = 0
) -> list[TrafficTerm]:
    """Every term of one training step on the rank `job` is built for (`build_planning_rank`),
    for any layout: TP regions of this rank's layers (the embedding on the first stage, the head
    and cross-entropy on the last), its gradient buckets and ZeRO-1 exchange, the scalars of the
    loss and the norm, the routing statistics of its MoE layers, and the pipeline hops and expert
    all-to-alls (`layout_traffic.pipeline_expert_traffic`; `replica_matrices` expert matrices
    received per layer, none on a first step). `micro_batches` is per rank and step."""
    config = job.config
    state, model, optimizer, reducer = job.parallel, job.model, job.optimizer, job.reducer
    cfg, optimizer_config = config.model, config.optimizer
    tp, dp, pp = state.layout.tp, state.layout.dp, state.layout.pp
    zero1 = config.parallel.zero1
    micro_batch_size, seq_length = config.train.micro_batch_size, config.data.seq_length
    bucket_bytes = optimizer.bucket_bytes
    sp = config.parallel.sequence_parallel and tp > 1
    terms: list[TrafficTerm] = []

    def add(group: str, what: str, nbytes: int, messages: int) -> None:
        if messages:
            terms.append(TrafficTerm(group, what, int(nbytes), int(messages)))

    local_layers = [i for start, end in job.plan.layer_ranges(state.pp_rank) for i in range(start, end)]
    first_stage = job.plan.rank_of(0) == state.pp_rank  # the embedding's stage
    last_stage = job.plan.rank_of(job.plan.num_chunks - 1) == state.pp_rank
    layers = len(local_layers)
    moe_layers = sum(cfg.is_moe_layer(i) for i in local_layers)
    dense_layers = layers - moe_layers
    float_bytes = 8 if dtype_bytes == 8 else 4  # CE and router scores: fp32, or fp64 in a float64 model
    M = micro_batches
    tokens = micro_batch_size * seq_length
    full = tokens * cfg.hidden_size * dtype_bytes  # N: one micro-batch's full-sequence activation
    shard = full // tp  # N / tp: its sequence shard

    # ---- tp: TP regions, embedding, head, cross-entropy, norm, Muon gathers
    if tp > 1:
        mlp_regions = dense_layers + (moe_layers if cfg.num_shared_experts > 0 else 0)
        regions = layers + mlp_regions
        # `parallel.ep_overlap_halves`: a model chunk whose layers alternate two halves of the
        # micro-batch runs each region once per half (the same bytes, twice the messages)
        halved = {
            layer.layer_index
            for chunk in model.chunks
            if any(layer.alternates_halves() for layer in chunk._decoder_layers())
            for layer in chunk._decoder_layers()
        }
        region_calls = sum(
            (2 if i in halved else 1) * (1 + (not cfg.is_moe_layer(i) or cfg.num_shared_experts > 0))
            for i in local_layers
        )
        # Overlapped entries (parallel/tensor_overlap.py: every mixer and MLP region) move the same
        # bytes in pieces along the sequence: one message per piece in forward and in backward.
        # Overlapped leaves reduce their row-parallel products in pieces too (forward; and under SP
        # the output gradient's all-gather in backward).
        local_sequence = seq_length // state.layout.cp // (tp if sp else 1)
        pieces = overlapped_entry_pieces(job, local_sequence) if sp else 1
        leave_pieces = overlapped_leave_pieces(job, local_sequence)
        entry_extra = M * region_calls * (pieces - 1)
        extra = entry_extra + M * region_calls * (leave_pieces - 1)
        in_pieces = ", ".join(
            f"{what} in {count} pieces" for what, count in (("entries", pieces), ("leaves", leave_pieces)) if count > 1
        )
        in_pieces = f" ({in_pieces})" if in_pieces else ""
        if sp:
            add(
                "tp",
                f"{regions} TP regions fwd: enter all-gather N/tp + leave reduce-scatter N" + in_pieces,
                M * regions * (shard + full),
                M * region_calls * 2 + extra,
            )
            add(
                "tp",
                f"{regions} TP regions bwd: leave all-gather N/tp + enter reduce-scatter N" + in_pieces,
                M * regions * (shard + full),
                M * region_calls * 2 + extra,
            )
        else:
            add(
                "tp",
                f"{regions} TP regions fwd: leave all-reduce N" + in_pieces,
                M * regions * full,
                M * region_calls * leave_pieces,
            )
            add("tp", f"{regions} TP regions bwd: enter all-reduce N", M * regions * full, M * region_calls)
        if cfg.recompute == "sublayer" and sp:  # every region sits in a recomputed sublayer
            add(
                "tp",
                f"recompute=sublayer: {regions} regions' enter all-gather N/tp again in backward",
                M * regions * shard,
                M * regions + entry_extra,
            )
        if sp:
            if first_stage:
                add("tp", "embedding leave: reduce-scatter N fwd + all-gather N/tp bwd", M * (full + shard), 2 * M)
            if last_stage:
                add("tp", "head enter: all-gather N/tp fwd + reduce-scatter N bwd", M * (shard + full), 2 * M)
        else:
            if first_stage:
                add("tp", "embedding leave: all-reduce N fwd", M * full, M)
            if last_stage:
                add("tp", "head enter: all-reduce N bwd", M * full, M)
        if last_stage:
            add("tp", "vocab-parallel CE: 3 all-reduces of [b·s]", M * 3 * tokens * float_bytes, 3 * M)
        add("tp", "global grad norm: fp32 scalar all-reduce", 4, 1)

    if tp > 1:
        stepped = set(optimizer.owned_parameter_names())
        split = getattr(optimizer.optimizer, "split", None)  # Newton–Schulz split over DP without ZeRO-1
        if split is not None:
            stepped = {name for name, param in model.named_parameters() if split.computes(param)}
        gathered = [
            route.param
            for route in route_parameters(model, optimizer_config)
            if route.route == "muon"
            and route.name in stepped
            and is_tensor_parallel(route.param)
            and block_layout(route.param, optimizer_config.muon_per_head).kind == "matrix"
        ]
        add(
            "tp",
            f"Muon: all-gather of {len(gathered)} sharded whole matrices' momentum"
            + (" (owned ones)" if dp > 1 and (zero1 or split is not None) else ""),
            sum(p.numel() * p.element_size() for p in gathered),
            len(gathered),
        )

    # ---- dp / data_tensor: gradient buckets, loss, ZeRO-1 exchange
    for group_name in ("dp", "data_tensor", "expert_dp"):
        reduced = [
            b
            for b in reducer.buckets
            if not b.sharded and b.reduction.group.name == group_name and b.reduction.group.size > 1
        ]
        if reduced:
            tensors = sum(len(b.params) for b in reduced)
            add(
                group_name,
                f"gradient buckets, all-reduce: {tensors} tensors, {sum(b.numel for b in reduced)} elements (+flags)",
                sum(b.nbytes for b in reduced),
                len(reduced),
            )
        for partial in (False, True):
            scattered = [
                b
                for b in reducer.buckets
                if b.sharded and b.owner_group.name == group_name and (b.then_over is not None) == partial
            ]
            if not scattered:
                continue
            tensors = sum(len(b.params) for b in scattered)
            padded = sum(b.owner_group.size * b.segment - b.numel - len(b.params) for b in scattered)
            add(
                group_name,
                "gradient buckets, ZeRO-1 reduce-scatter to owners"
                + (" (TP-partial gradients)" if partial else "")
                + f": {tensors} tensors, "
                f"{sum(b.numel for b in scattered)} elements (+flags, +{padded} padding) in "
                f"{group_name}-size per-owner segments",
                sum(b.nbytes for b in scattered),
                len(scattered),
            )
            if partial and tp > 1:
                add(
                    "tp",
                    f"ZeRO-1: the owners' segments of those {len(scattered)} buckets, all-reduce over tp "
                    "(each TP rank held a partial sum)",
                    sum(b.sent()["tp"][0] for b in scattered),
                    len(scattered),
                )
    if any(b.sharded for b in reducer.buckets) and state.data_tensor.size > 1:
        add("data_tensor", "global grad norm, owner-only gradients' share: fp32 scalar all-reduce", 4, 1)
    if dp > 1:
        add("dp", "loss average: fp64 scalar all-reduce", 8, 1)
    if pp > 1:
        if last_stage:
            add("pp", "step loss: fp64 scalar broadcast from the last stage", 8, 1)
        add("pp", "global grad norm: fp32 scalar all-reduce over the stages", 4, 1)
    for exchange in optimizer._exchanges:
        element = torch.empty((), dtype=exchange.dtype).element_size()
        chunk = max(1, bucket_bytes // element)
        add(
            exchange.group.name,
            f"ZeRO-1 exchange ({exchange.dtype}): padded buffer of {exchange.length} elements",
            exchange.length * element,
            math.ceil(exchange.length / chunk),
        )
        mine = [p for p, owner in exchange.broadcast if owner == exchange.group.rank]
        add(
            exchange.group.name,
            f"ZeRO-1 exchange ({exchange.dtype}): broadcast of {len(mine)} owned parameters larger than a rank's share",
            sum(p.numel() for p in mine) * element,
            len(mine),
        )

    split = getattr(optimizer.optimizer, "split", None)
    for exchange in split.exchanges if split is not None else []:
        element = torch.empty((), dtype=exchange.dtype).element_size()
        chunk = max(1, bucket_bytes // element)
        add(
            exchange.group.name,
            f"Muon updates split over DP ({exchange.dtype}): padded buffer of {exchange.length} elements",
            exchange.length * element,
            math.ceil(exchange.length / chunk),
        )

    # ---- routing statistics on the routing group
    routing_group = state.data_tensor if sp else state.dp
    if routing_group.size > 1 and moe_layers:
        name = routing_group.name
        experts = cfg.num_experts
        # One all-reduce pools every layer's summable statistics (`moe.pool_routing_statistics`).
        # Per layer: E token loads plus the dispatch counters, read off the built model.
        counters = next(
            module.step_dispatch_counts.numel() for module in model.modules() if isinstance(module, LatentMoE)
        )
        pooled_elements = moe_layers * (experts + counters)
        described = f"{moe_layers} × (E+{counters}) loads and dispatch counters"
        if cfg.balancer == "quantile_histogram":
            pooled_elements += moe_layers * experts * cfg.balancer_bins
            described += f" + {moe_layers} × E×bins histograms"
        elif cfg.balancer == "sign":
            pooled_elements += moe_layers * experts
            described += f" + {moe_layers} × E balancer loads"
        add(name, f"routing statistics, one all-reduce: {described}, int64", pooled_elements * 8, 1)
        if cfg.balancer == "quantile":
            local_tokens = M * tokens // (tp if sp else 1)
            add(
                name,
                f"balancer: {moe_layers} × all-gather of [{local_tokens}, E] margins",
                moe_layers * local_tokens * experts * float_bytes,
                moe_layers,
            )
    for group, (nbytes, messages) in pipeline_expert_traffic(job, micro_batches, replica_matrices).items():
        what = {
            "pp.forward": "pipeline hops forward: residual + the AttnRes blocks the receiver lacks",
            "pp.backward": "pipeline hops backward: their gradients",
            "ep": "expert all-to-alls (dispatch, ids, combine, their adjoints; loads) and the expert share of the norm",
            "ep.replicas": f"replica weights out and their gradients back, {replica_matrices} matrices per layer",
        }[group]
        add(group, what, nbytes, messages)
    return terms


def predicted_step_traffic(model_config, optimizer_config, **kwargs) -> dict[str, tuple[int, int]]:
    """`{group name: (bytes, messages)}` one rank sends in one training step, in the form of
    `TrafficCounter.snapshot()`; the arguments are `step_traffic_terms`'."""
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for term in step_traffic_terms(model_config, optimizer_config, **kwargs):
        totals[term.group][0] += term.bytes
        totals[term.group][1] += term.messages
    return {name: (totals[name][0], totals[name][1]) for name in sorted(totals)}


def predicted_job_traffic(
    job: RankJob, micro_batches: int, dtype_bytes: int = 4, replica_matrices: int = 0
) -> dict[str, tuple[int, int]]:
    """`{group name: (bytes, messages)}` of `job_traffic_terms`, as `TrafficCounter.snapshot()`."""
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for term in job_traffic_terms(job, micro_batches, dtype_bytes, replica_matrices):
        totals[term.group][0] += term.bytes
        totals[term.group][1] += term.messages
    return {name: (totals[name][0], totals[name][1]) for name in sorted(totals)}


def describe_terms(terms: list[TrafficTerm]) -> str:
    """The terms as markdown table rows (group, what, bytes, messages)."""
    lines = ["| group | term | bytes | messages |", "| --- | --- | ---: | ---: |"]
    lines += [f"| {t.group} | {t.what} | {t.bytes:,} | {t.messages} |" for t in terms]
    return "\n".join(lines)


__all__ = [
    "TrafficTerm",
    "step_traffic_terms",
    "job_traffic_terms",
    "predicted_step_traffic",
    "predicted_job_traffic",
    "describe_terms",
]
