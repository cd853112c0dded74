"""Worker side of tests/distributed/test_context_parallel.py: context parallelism against one process.

One launch of gloo ranks runs a list of layouts. For each, every rank builds its job exactly as
`pretrain_k3.py` does (`training.build.build_rank`: model chunks, gradient reducer over dp × cp,
pipeline schedule), in float64, runs one step's forward and backward over its data rank's rows
(each cp rank keeping its own pieces of every sequence), reduces the gradients, and compares the
step loss and every gradient with a single-process model that ran the whole global batch.
Only numbers travel back to the test (tolerances are stated there).
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import torch

from k3train.config import JobConfig
from k3train.data.config import DataConfig
from k3train.model.config import LinearAttnConfig, ModelConfig
from k3train.model.k3 import K3ModelChunk
from k3train.model.moe import finish_expert_step
from k3train.parallel.config import ModelSplitSizes, ParallelConfig
from k3train.parallel.expert import ExpertParameter
from k3train.parallel.grad_reduce import average_over_dp
from k3train.parallel.state import ParallelState, resolve_layout
from k3train.parallel.tensor import ShardedParameter
from k3train.planning.context import context_step_bytes
from k3train.training.build import build_rank
from k3train.training.config import TrainConfig

SEED = 11

# The debug model at half width: KDA and Gated MLA layers (layer 3 is MLA), dense and MoE FFNs,
# Block AttnRes; a KDA chunk of 8 tokens so short sequences cover several chunks per piece.
CONFIG = ModelConfig(
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    linear_attn_config=LinearAttnConfig(num_heads=4, head_dim=16, chunk_size=8),
    intermediate_size=128,
    num_experts=8,
    num_experts_per_token=2,
    moe_intermediate_size=32,
    routed_expert_hidden_size=32,
    attn_res_block_size=2,
    recompute="none",
    balancer="quantile_histogram",
)


def job_config(spec: dict[str, Any]) -> JobConfig:
    parallel = ParallelConfig(
        tp=spec.get("tp", 1),
        pp=spec.get("pp", 1),
        ep=spec.get("ep", 1),
        cp=spec["cp"],
        sequence_parallel=spec.get("sp", False),
        zero1=False,
        # Capacity dispatch with capacity_factor = ep keeps every routed slot (the
        # balanced mode's first step has no replicas yet and may drop).
        expert_dispatch="capacity",
        capacity_factor=float(spec.get("ep", 1)),
    )
    train = TrainConfig(
        global_batch_size=spec["global_batch"], micro_batch_size=spec["micro_batch"], precision="fp32", device="cpu"
    )
    config = JobConfig(model=CONFIG, parallel=parallel, data=DataConfig(seq_length=spec["seq"]), train=train)
    config.validate()
    return config


def reference_view(full: torch.Tensor, param: torch.Tensor, state: ParallelState) -> torch.Tensor:
    if getattr(param, "expert_parallel", False):
        return full.narrow(0, cast(ExpertParameter, param).expert_offset, param.shape[0])
    if getattr(param, "tensor_parallel", False):
        return full.chunk(state.tp.size, dim=cast(ShardedParameter, param).partition_dim)[state.tp.rank]
    return full


def compare(env, spec: dict[str, Any]) -> dict[str, Any]:
    config = job_config(spec)
    p = config.parallel
    layout = resolve_layout(env.world_size, p.tp, p.pp, 0, p.ep, 1, ModelSplitSizes.of(CONFIG), cp=p.cp)
    state = ParallelState(layout, env.rank, sequence_parallel=p.sequence_parallel)
    job = build_rank(config, state, torch.device("cpu"), overlap=False, dtype=torch.float64)
    job.schedule.dtype = torch.float64  # pipeline hops in the model's dtype
    for chunk in job.model.chunks:  # how the KDA states cross the pieces (parallel/context.py)
        chunk.cp.state_exchange = spec.get("state_exchange", "handoff")

    generator = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, CONFIG.vocab_size, (spec["global_batch"], spec["seq"] + 1), generator=generator)

    reference = K3ModelChunk(CONFIG, seed=config.train.seed).double()
    reference_loss = reference.loss(reference(tokens[:, :-1]), tokens[:, 1:])
    reference_loss.backward()

    rows = spec["global_batch"] // layout.data_parallel
    mine = tokens[state.data_rank * rows : (state.data_rank + 1) * rows]
    micro_batches = list(mine.split(spec["micro_batch"]))
    state.counter.reset()
    local_loss = job.schedule.run(job.model.chunks, micro_batches)
    job.reducer.finish()
    finish_expert_step(job.model.moe_layers(), state)
    loss = average_over_dp(local_loss, state).item()

    reference_params = dict(reference.named_parameters())
    worst, worst_name, checked = 0.0, "", 0
    for name, param in job.model.named_parameters():
        reference_grad = reference_params[name].grad
        if reference_grad is None:
            assert param.grad is None or torch.all(param.grad == 0), name
            continue
        expected = reference_view(reference_grad, param, state)
        assert param.grad is not None, f"{name}: no gradient"
        assert param.grad.shape == expected.shape, (name, param.grad.shape, expected.shape)
        error = (param.grad - expected).abs().max().item()
        checked += 1
        if error > worst:
            worst, worst_name = error, name
    # The balancers' statistics pooled over every rank that routed distinct tokens (dp × cp, and
    # tp under sequence parallelism: the trainer's routing group) give the single-process biases.
    reference.update_routing_biases()
    job.model.update_routing_biases(state.data_tensor if state.sequence_parallel else state.dp)
    reference_biases = {
        name: moe.gate.e_score_correction_bias
        for name, moe in ((n, m) for n, m in reference.named_modules() if hasattr(m, "balancer"))
    }
    bias_error = max(
        (
            (moe.gate.e_score_correction_bias - reference_biases[name]).abs().max().item()
            for name, moe in job.model.named_modules()
            if hasattr(moe, "balancer")
        ),
        default=0.0,
    )
    traffic = state.counter.snapshot()
    layers = [i for start, end in job.plan.layer_ranges(state.pp_rank) for i in range(start, end)]
    planned = context_step_bytes(
        CONFIG,
        layers,
        cp=layout.cp,
        tp=layout.tp,
        micro_batch_size=spec["micro_batch"],
        seq_length=spec["seq"],
        micro_batches=len(micro_batches),
        element_bytes=8,
        state_bytes=8,
        state_exchange=spec.get("state_exchange", "handoff"),
        cp_rank=state.cp_rank,
    )
    return {
        "name": spec["name"],
        "loss": loss,
        "reference_loss": reference_loss.item(),
        "max_grad_error": worst,
        "worst_param": worst_name,
        "checked": checked,
        "bias_error": bias_error,
        "cp_bytes": traffic.get("cp", (0, 0))[0],
        "cp_messages": traffic.get("cp", (0, 0))[1],
        "planned_cp_bytes": planned,
    }


def run_checks(env, payload: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [compare(env, dataclasses.replace(spec) if dataclasses.is_dataclass(spec) else spec) for spec in payload]
