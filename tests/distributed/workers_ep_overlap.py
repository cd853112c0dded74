"""Worker side of `benchmarks/ep_overlap.py --dispatcher`: one MoE layer's dispatcher alone (no
attention, no other layers) on every rank, its EP link emulated, timed forward and backward with
and without the overlapped schedule. Not a test: timings are printed, never asserted."""

from __future__ import annotations

import dataclasses
import time

import torch

from k3train.parallel.comm import EmulatedLink
from k3train.parallel.config import ModelSplitSizes
from k3train.parallel.expert import ExpertParallel
from k3train.parallel.state import ParallelState, resolve_layout
from tests.distributed.workers_expert_dispatcher import home_experts, small_config


def dispatcher_timing(env, spec: dict) -> dict:
    config = dataclasses.replace(
        small_config(num_experts=4 * env.world_size, num_experts_per_token=4), moe_intermediate_size=spec["inner"]
    )
    layout = resolve_layout(env.world_size, 1, 1, 0, env.world_size, 1, ModelSplitSizes.of(config))
    state = ParallelState(layout, env.rank)
    dispatcher = ExpertParallel(
        state.ep, config.num_experts, transport=spec["transport"], overlap_chunks=spec["chunks"]
    )
    from k3train.model.moe import GroupedExperts

    full = GroupedExperts(config, config.num_experts)
    mine = home_experts(config, dispatcher, full, {})
    state.ep.link = EmulatedLink(spec["bandwidth_gbps"] * 1e9, spec["latency_us"] * 1e-6)
    generator = torch.Generator().manual_seed(env.rank)
    tokens, top_k = spec["tokens"], config.num_experts_per_token
    latent = torch.randn(tokens, config.expert_width, generator=generator, requires_grad=True)
    expert_ids = torch.randint(0, config.num_experts, (tokens, top_k), generator=generator)
    weights = torch.rand(tokens, top_k, generator=generator)
    samples = []
    for _ in range(spec["repeats"]):
        state.counter.wait_seconds.clear()
        started = time.perf_counter()
        routed, _ = dispatcher(latent, expert_ids, weights, mine)
        routed.square().sum().backward()
        elapsed = time.perf_counter() - started
        waited = sum(s for label, s in state.counter.wait_seconds.items() if label.split(".")[0] == "ep")
        samples.append((elapsed, waited))
    samples = samples[1:]  # the first one warms up
    return {
        "layer_s": sum(s for s, _ in samples) / len(samples),
        "ep_exposed_s": sum(w for _, w in samples) / len(samples),
    }


def run(env, payload: list[dict]) -> list[dict]:
    return [dispatcher_timing(env, spec) for spec in payload]


def model_timing(env, payload: dict) -> list[dict]:
    """`benchmarks/ep_overlap.py --model`: the model's forward and backward (no data loader, no
    optimizer) on every rank, its EP link emulated, for each row of `payload["rows"]`
    (`(chunks, halves)`), the rows alternated `payload["repeats"]` times after a warm-up each;
    per row, the median seconds of one step's forwards and backwards (one micro-batch, or with
    `pp` > 1 the pipeline schedule's micro-batches) and of rank 0's EP waits in them."""
    import statistics

    from k3train.config import load_config
    from k3train.parallel.pipeline import PipelineExecutor, PipelinePlan, residual_shape
    from k3train.training.build import build_model
    from tests.distributed.workers_expert import use_expert_parallel

    job = load_config(payload["recipe"], payload["overrides"])
    config, tp, pp = job.model, payload["tp"], payload["pp"]
    layout = resolve_layout(env.world_size, tp, pp, 0, 2, 1, ModelSplitSizes.of(config))
    state = ParallelState(layout, env.rank, sequence_parallel=tp > 1)
    state.ep.link = EmulatedLink(payload["bandwidth_gbps"] * 1e9, payload["latency_us"] * 1e-6)
    size, seq = job.train.micro_batch_size, job.data.seq_length
    generator = torch.Generator().manual_seed(state.dp_rank)  # the TP ranks of a DP rank share its rows
    micro_batches = [torch.randint(0, config.vocab_size, (size, seq + 1), generator=generator) for _ in range(pp)]
    plan = PipelinePlan.build(config.num_hidden_layers, pp, 1, config.attn_res, config.attn_res_block_size)
    shape = residual_shape(size, seq, config.hidden_size, tp, tp > 1)
    models = []
    for chunks, halves in payload["rows"]:
        dispatcher = ExpertParallel(
            state.ep,
            config.num_experts,
            transport=payload["transport"],
            overlap_chunks=chunks,
            overlap_halves=halves,
            replica_planning="step",
        )
        model_chunks = build_model(config, plan, state, seed=7).chunks
        for chunk in model_chunks:
            for moe in chunk.moe_layers():
                use_expert_parallel(moe, dispatcher)
        models.append(model_chunks)

    def forward_backward(model_chunks) -> tuple[float, float]:
        state.counter.wait_seconds.clear()
        started = time.perf_counter()
        if pp > 1:
            PipelineExecutor(plan, state.pp, shape).run(model_chunks, micro_batches)
        else:
            (model,) = model_chunks
            tokens = micro_batches[0]
            model.loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        elapsed = time.perf_counter() - started
        for chunk in model_chunks:
            chunk.zero_grad(set_to_none=True)
        return elapsed, sum(s for label, s in state.counter.wait_seconds.items() if label.split(".")[0] == "ep")

    for model_chunks in models:
        forward_backward(model_chunks)  # warm-up: first-call costs
    samples: list[list[tuple[float, float]]] = [[] for _ in models]
    for _ in range(payload["repeats"]):
        for index, model_chunks in enumerate(models):
            samples[index].append(forward_backward(model_chunks))
    return [
        {
            "seconds": statistics.median(s for s, _ in row),
            "ep_exposed_s": statistics.median(w for _, w in row),
        }
        for row in samples
    ]
