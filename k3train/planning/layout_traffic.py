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

from k3train.training.build import RankJob


def layout_step_bytes(job: RankJob, micro_batches: int) -> dict[str, float]:
    """Per group: bytes this rank sends (comm.py's convention) in one training step."""
    config = job.config
    cfg, layout = config.model, job.parallel.layout
    element = 2 if config.train.precision == "bf16" else 4
    b, s, h, tp = config.train.micro_batch_size, config.data.seq_length, cfg.hidden_size, layout.tp
    sp = config.parallel.sequence_parallel and tp > 1
    full = b * s * h * element
    shard = full // tp if sp else full
    out: dict[str, float] = defaultdict(float)
    layers = [i for start, end in job.plan.layer_ranges(job.parallel.pp_rank) for i in range(start, end)]
    moe = sum(cfg.is_moe_layer(i) for i in layers)
    if tp > 1:
        regions = len(layers) + (len(layers) - moe) + (moe if cfg.num_shared_experts else 0)
        out["tp"] += micro_batches * regions * 2 * (full + (shard if sp else 0))
    for bucket in job.reducer.buckets:
        out[bucket.reduction.group.name] += bucket.nbytes
    for exchange in job.optimizer._exchanges:
        out[exchange.group.name] += exchange.length * torch.empty((), dtype=exchange.dtype).element_size()
    if layout.pp > 1:
        hops = job.plan.rank_step_bytes(job.parallel.pp_rank, shard, micro_batches)
        out["pp"] += hops["forward"] + hops["backward"]
    if job.expert_parallel is not None and moe:
        shapes = job.expert_parallel.buffer_shapes(b * s // (tp if sp else 1), cfg.num_experts_per_token,
                                                   cfg.routed_expert_hidden_size, cfg.moe_intermediate_size)
        per_layer = 2 * (math.prod(shapes["dispatch"]) * element + math.prod(shapes["dispatch_ids"]) * 4)
        per_layer += 2 * math.prod(shapes["combine"]) * element  # forward, and their gradients back
        if "slot_counts" in shapes:
            per_layer += math.prod(shapes["slot_counts"]) // job.expert_parallel.size * 8
            per_layer += 2 * math.prod(shapes["replica_weights"]) * 4
        out["ep"] += micro_batches * moe * per_layer
    return dict(out)


__all__ = ["layout_step_bytes"]
