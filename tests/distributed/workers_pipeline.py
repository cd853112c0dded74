"""Worker side of the pipeline-parallel checks (run through harness.run_workers).

`run_checks` runs a list of pipeline configurations in one group of gloo workers. For each, every
rank builds the single-process reference model in-process from the same seed (initialisation
depends only on the seed and parameter names), computes the mean loss of the global batch and its
gradients in float64, then runs its own pipeline chunks through `PipelineExecutor` on the same
micro-batches and compares the loss and the gradient of every parameter it holds. It also returns
the bytes its pipeline hops sent (`pp.forward` / `pp.backward` counters of comm.py) beside the
plan's exact-delta prediction, and, when asked, the block-cache accounting: the live block count
after every step against `PipelinePlan.held_blocks`, and whether any tensor saved for backward is
a second copy of a cached block.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Sequence
from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from k3train.model.config import ModelConfig
from k3train.model.k3 import K3ModelChunk
from k3train.parallel.config import ModelSplitSizes
from k3train.parallel.pipeline import (
    PROTOCOLS,
    PipelineExecutor,
    PipelinePlan,
    residual_shape,
    theoretical_peak_blocks,
)
from k3train.parallel.state import ParallelState, resolve_layout
from k3train.parallel.tensor import ShardedParameter, reduce_tensor_parallel_grads
from k3train.training.build import build_model

SEED = 7
SEQ = 16
MICRO_BATCH_SIZE = 2


def small_config(**changes) -> ModelConfig:
    base = ModelConfig(
        num_hidden_layers=8,
        hidden_size=64,
        intermediate_size=128,
        num_experts=4,
        num_experts_per_token=2,
        moe_intermediate_size=32,
        routed_expert_hidden_size=32,
        attn_res_block_size=3,
        recompute="attn_res",
    )
    return dataclasses.replace(base, **changes)


def local_view(full: torch.Tensor, param: torch.Tensor, tp_size: int, tp_rank: int) -> torch.Tensor:
    if getattr(param, "tensor_parallel", False):
        return full.chunk(tp_size, dim=cast(ShardedParameter, param).partition_dim)[tp_rank]
    return full


class DataParallelAverage:
    """Average gradients over data parallel: the bucketed reducer of parallel/grad_reduce.py (overlapped
    with the pipeline's backward: reduction is switched on for each chunk's last backward), or a
    plain all-reduce if that module is not there."""

    def __init__(self, chunks: Sequence[nn.Module], state: ParallelState):
        self.chunks, self.state, self.reducer = chunks, state, None
        self.kind = "none" if state.dp.size == 1 else "all_reduce"
        if state.dp.size > 1:
            try:
                from k3train.parallel.grad_reduce import GradientReducer
            except ImportError:
                return
            self.reducer = GradientReducer(nn.ModuleList(chunks), state)
            self.kind = "GradientReducer"

    def before_backward(self, virtual_stage: int, last: bool) -> None:
        if self.reducer is not None:
            self.reducer.set_last_micro_batch(last)

    def finish(self) -> None:
        if self.reducer is not None:
            self.reducer.finish()
            self.reducer.remove_hooks()
        elif self.kind == "all_reduce":
            for chunk in self.chunks:
                for param in chunk.parameters():
                    if param.grad is not None:
                        self.state.dp.all_reduce(param.grad)
                        param.grad /= self.state.dp.size


class CacheProbe:
    """After every step: the cache holds exactly the theoretical blocks; tensors saved for
    backward by the chunk graphs are never a second copy of a cached block."""

    def __init__(self, plan: PipelinePlan, rank: int, shape: tuple[int, ...]):
        self.plan, self.rank, self.shape = plan, rank, shape
        self.expected: dict[int, int] = {}
        self.mismatches: list[str] = []
        self.saved: list[torch.Tensor] = []
        self.copies = 0  # saved tensors equal to a cached block but in another storage
        self.stacked_copies = 0  # blocks inside a saved stacked-sources tensor
        self.saved_alias = 0  # saved tensors that are a cached block's own storage

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.saved.append(tensor)
        return tensor

    def after_step(self, step, schedule) -> None:
        chunk = self.plan.chunk_index(self.rank, step.virtual_stage)
        self.expected[step.micro_batch] = self.plan.held_blocks(chunk, step.kind)
        if schedule.cache.live != sum(self.expected.values()):
            self.mismatches.append(f"{step}: live {schedule.cache.live} != {sum(self.expected.values())}")
        for mb in schedule.cache.micro_batches():
            held = schedule.cache.held(mb)
            if held != list(range(len(held))):
                self.mismatches.append(f"{step}: micro-batch {mb} holds {held}, not a prefix")
        if step.kind == "forward":
            blocks = schedule.cache.all_values()
            storages = {b.untyped_storage().data_ptr() for b in blocks}
            for tensor in self.saved:
                if not tensor.is_floating_point():
                    continue
                if tuple(tensor.shape) == self.shape:
                    if tensor.untyped_storage().data_ptr() in storages:
                        self.saved_alias += 1
                    elif any(torch.equal(tensor, b) for b in blocks):
                        self.copies += 1
                elif (
                    tensor.dim() == 4
                    and tuple(tensor.shape[:2]) == self.shape[:2]
                    and tensor.shape[-1] == self.shape[-1]
                ):
                    for k in range(tensor.shape[2]):
                        if any(torch.equal(tensor[:, :, k], b.to(tensor.dtype)) for b in blocks):
                            self.stacked_copies += 1
        self.saved = []


def run_one(env, check: dict) -> dict:
    config = small_config(**check.get("config", {}))
    tp, pp, virtual = check.get("tp", 1), check["pp"], check.get("virtual_stages", 1)
    sequence_parallel = check.get("sequence_parallel", False)
    layout = resolve_layout(env.world_size, tp, pp, 0, 1, virtual, ModelSplitSizes.of(config))
    state = ParallelState(layout, env.rank, sequence_parallel=sequence_parallel)
    plan = PipelinePlan.build(
        config.num_hidden_layers, pp, virtual, config.attn_res, config.attn_res_block_size, check.get("pipeline_layers")
    )

    # The global batch: `micro_batches` per data-parallel rank, the same on every rank.
    local_count = check["micro_batches"]
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(
        0, config.vocab_size, (local_count * state.dp.size * MICRO_BATCH_SIZE, SEQ + 1), generator=generator
    )
    reference = K3ModelChunk(config).double()
    reference.init_weights(seed=SEED)
    reference_loss = reference.loss(reference(tokens[:, :-1]), tokens[:, 1:])
    reference_loss.backward()

    micro_batches = list(tokens.split(MICRO_BATCH_SIZE))
    micro_batches = micro_batches[state.dp.rank * local_count : (state.dp.rank + 1) * local_count]
    chunks = build_model(config, plan, state, seed=SEED, dtype=torch.float64).chunks
    shape = residual_shape(MICRO_BATCH_SIZE, SEQ, config.hidden_size, state.tp.size, state.sequence_parallel)
    probe = CacheProbe(plan, state.pp.rank, shape) if check.get("probe") else None
    last_backward_calls: dict[int, int] = defaultdict(int)

    data_parallel = DataParallelAverage(chunks, state)

    def before_backward(virtual_stage: int, last: bool) -> None:
        last_backward_calls[virtual_stage] += int(last)
        data_parallel.before_backward(virtual_stage, last)

    schedule = PipelineExecutor(
        plan,
        state.pp,
        shape,
        dtype=torch.float64,
        trace_cache=probe is not None,
        after_step=probe.after_step if probe else None,
        before_backward=before_backward,
    )
    if probe is not None:
        with torch.autograd.graph.saved_tensors_hooks(probe.pack, lambda tensor: tensor):
            loss = schedule.run(chunks, micro_batches)
    else:
        loss = schedule.run(chunks, micro_batches)
    traffic = {name: state.counter.bytes.get(name, 0) for name in ("pp.forward", "pp.backward")}
    stats = schedule.stats
    forward_only_loss = None
    if check.get("forward_only"):  # evaluation: no graph, same loss (parameters are unchanged)
        schedule.after_step = None
        forward_only_loss = schedule.run(chunks, micro_batches, forward_only=True).item()
        assert schedule.cache.live == 0 and not schedule.cache.micro_batches()
    for chunk in chunks:
        reduce_tensor_parallel_grads(chunk, state.tp)
    data_parallel.finish()
    dp_reduction = data_parallel.kind
    if state.dp.size > 1:
        loss = state.dp.all_reduce(loss.clone()) / state.dp.size

    reference_params = dict(reference.named_parameters())
    worst, worst_name, checked = 0.0, "", []
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            reference_grad = reference_params[name].grad
            if reference_grad is None:
                assert param.grad is None or torch.all(param.grad == 0), (
                    f"{name}: gradient where the reference has none"
                )
                checked.append(name)
                continue
            assert param.grad is not None, f"{check['name']}: {name} has no gradient"
            expected = local_view(reference_grad, param, state.tp.size, state.tp.rank)
            error = (param.grad - expected).abs().max().item()
            checked.append(name)
            if not math.isfinite(error) or error > worst:
                worst, worst_name = error, name

    tensor_bytes = math.prod(shape) * 8
    predicted = plan.rank_step_bytes(state.pp.rank, tensor_bytes, local_count)
    result = {
        "name": check["name"],
        "rank": env.rank,
        "loss": loss.item(),
        "reference_loss": reference_loss.item(),
        "max_grad_error": worst,
        "worst_param": worst_name,
        "checked": checked,
        "all_reference_params": sorted(reference_params),
        "traffic": traffic,
        "predicted": predicted,
        "protocol_bytes": {p: plan.step_bytes(tensor_bytes, local_count, p) for p in PROTOCOLS},
        "hop_blocks": {p: plan.hop_block_counts(p) for p in PROTOCOLS},
        "peak_live_blocks": stats.peak_live_blocks,
        "forward_only_loss": forward_only_loss,
        "last_backward_calls": dict(last_backward_calls),
        "theoretical_peak": theoretical_peak_blocks(plan, state.pp.rank, local_count),
        "dp_reduction": dp_reduction,
        "pp_rank": state.pp.rank,
        "tp_rank": state.tp.rank,
        "dp_rank": state.dp.rank,
        "seconds": stats.total_s,
    }
    if probe is not None:
        result.update(
            probe_mismatches=probe.mismatches,
            saved_copies=probe.copies,
            stacked_copies=probe.stacked_copies,
            saved_alias=probe.saved_alias,
        )
    return result


def run_checks(env, payload) -> list[dict]:
    results = []
    for check in payload["checks"]:
        results.append(run_one(env, check))
        dist.barrier()
    return results
