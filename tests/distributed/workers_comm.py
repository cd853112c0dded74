"""Worker side of the traffic checks (`test_comm_traffic.py`, `benchmarks/comm.py`): every layout
runs one real training step and reports what comm.py counted beside the formula's prediction.

One launch runs several layouts in turn. Each is built the way `pretrain_k3.main` builds a job
(`k3train.training.build.build_rank`: model chunks from the seed, `GradientReducer`,
`DistributedOptimizer`, `PipelineExecutor`; then data and `Trainer`), its counter is reset after set-up, and `Trainer.train_step()`
runs once: the counter then holds exactly one step (schedule, reduction, loss average, clipping,
optimizer step, routing statistics). A layout with fewer ranks than the launch (DP2, TP2 in a
4-rank launch) runs on ranks 0..world-1; the other ranks only take part in creating its groups
(`torch.distributed.new_group` must be entered by every process) and wait at a barrier.
"""

from __future__ import annotations

import time
from typing import Any

import torch.distributed as dist

from k3train.config import load_config
from k3train.parallel.config import ModelSplitSizes
from k3train.parallel.state import ParallelState, emulated_links, resolve_layout
from k3train.planning.measured import build_trainer, layout_batching, layout_overrides
from k3train.planning.traffic import predicted_job_traffic, predicted_step_traffic, step_traffic_terms
from k3train.training import loop
from k3train.training.build import build_planning_rank


def measure_layout(env, layout: dict[str, Any], payload: dict[str, Any]) -> dict[str, Any]:
    micro_batch_size, micro_batches = layout_batching(layout, payload["micro_batch_size"], payload["micro_batches"])
    seq_length = payload["seq_length"]
    config = load_config(payload["recipe"], layout_overrides(layout, micro_batch_size, micro_batches, seq_length))
    tp, dp, pp, ep = config.parallel.tp, config.parallel.dp, config.parallel.pp, config.parallel.ep
    world = tp * dp * pp
    model_config = config.model
    grid = resolve_layout(world, tp, pp, dp, ep, config.parallel.virtual_stages, ModelSplitSizes.of(model_config))
    member = env.rank < world
    # Every process creates the layout's groups in the same order; non-members pose as rank 0.
    state = ParallelState(
        grid,
        env.rank if member else 0,
        sequence_parallel=config.parallel.sequence_parallel,
        network=emulated_links(config.parallel.emulate_network),
        tp_overlap_chunks=config.parallel.tp_overlap_chunks,
    )
    result: dict[str, Any] = {"name": layout["name"], "member": member}
    if member:
        started = time.perf_counter()
        trainer = build_trainer(config, state)
        real_memory = loop.rank_memory_gib
        if world < env.world_size:
            # Its uncounted all-gather runs on the default group, which has every launched process.
            loop.rank_memory_gib = lambda device, world_size: [0.0] * world_size
        try:
            state.counter.reset()
            metrics = trainer.train_step()
        finally:
            loop.rank_memory_gib = real_memory
        measured = state.counter.snapshot()
        result["exposed"] = metrics["exposed_comm_s"]
        # Every layout: the whole step of this rank from its meta-device build (any pp, ep).
        job = build_planning_rank(config, grid, env.rank)
        result["predicted_job"] = predicted_job_traffic(job, micro_batches)
        if pp > 1 or ep > 1:
            result.update(
                measured=measured,
                predicted=result["predicted_job"],
                loss=metrics["loss"],
                seconds=time.perf_counter() - started,
            )
            dist.barrier()
            return result
        arguments = dict(
            tp=tp,
            dp=dp,
            micro_batch_size=micro_batch_size,
            seq_length=seq_length,
            micro_batches=micro_batches,
            dtype_bytes=4,
            zero1=config.parallel.zero1,
            sequence_parallel=config.parallel.sequence_parallel,
            tp_rank=state.tp_rank,
            dp_rank=state.dp_rank,
            tp_overlap_chunks=config.parallel.tp_overlap_chunks,
        )
        result.update(
            measured=measured,
            predicted=predicted_step_traffic(model_config, config.optimizer, **arguments),
            terms=[vars(term) for term in step_traffic_terms(model_config, config.optimizer, **arguments)]
            if env.rank == 0
            else None,
            loss=metrics["loss"],
            seconds=time.perf_counter() - started,
        )
    dist.barrier()
    return result


def run_layouts(env, payload: dict[str, Any]) -> list[dict[str, Any]]:
    """`payload`: recipe, micro_batch_size, micro_batches, seq_length, layouts (each a dict of
    name, tp, dp, sequence_parallel, zero1 and extra overrides). Returns one result per layout."""
    return [measure_layout(env, layout, payload) for layout in payload["layouts"]]
