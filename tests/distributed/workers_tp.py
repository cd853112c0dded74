"""Worker side of the tensor/sequence-parallel equivalence checks (run through harness.run_workers).

Each worker builds the single-process model and its TP shard of the same model from the same
seed (initialisation depends only on the seed and parameter names), runs one forward/backward
on the same batch in float64, and compares the loss and every gradient with the matching slice
of the single-process one.
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import torch

from k3train.model.config import ModelConfig
from k3train.model.k3 import K3ModelChunk
from k3train.parallel.config import ModelSplitSizes
from k3train.parallel.state import ParallelState, resolve_layout
from k3train.parallel.tensor import ShardedParameter, reduce_tensor_parallel_grads


def small_config(**changes) -> ModelConfig:
    return dataclasses.replace(ModelConfig(num_hidden_layers=4, attn_res_block_size=2, recompute="none"), **changes)


def build_state(
    world_size: int, rank: int, tp: int, sequence_parallel: bool, config: ModelConfig, tp_overlap_chunks: int = 0
) -> ParallelState:
    layout = resolve_layout(world_size, tp, 1, 0, 1, 1, ModelSplitSizes.of(config))
    return ParallelState(layout, rank, sequence_parallel=sequence_parallel, tp_overlap_chunks=tp_overlap_chunks)


def local_view(full: torch.Tensor, param: torch.Tensor, tp_size: int, tp_rank: int) -> torch.Tensor:
    if getattr(param, "tensor_parallel", False):
        return full.chunk(tp_size, dim=cast(ShardedParameter, param).partition_dim)[tp_rank]
    return full


def _models(env, payload) -> tuple[ModelConfig, ParallelState, K3ModelChunk, K3ModelChunk]:
    """(config, state, the single-process model, this rank's TP model), float64, same weights."""
    config = small_config(**payload.get("config", {}))
    state = build_state(
        env.world_size,
        env.rank,
        payload["tp"],
        payload["sequence_parallel"],
        config,
        payload.get("tp_overlap_chunks", 0),
    )
    reference = K3ModelChunk(config).double()
    reference.init_weights(seed=7)
    sharded = K3ModelChunk(config, parallel=state).double()
    sharded.init_weights(seed=7)
    return config, state, reference, sharded


def compare_one_step(env, payload) -> dict:
    """Loss and gradients of a TP(+SP) model against the single-process model, float64."""
    config, state, reference, sharded = _models(env, payload)

    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, config.vocab_size, (2, 33), generator=generator)  # same batch on every TP rank
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    reference_loss = reference.loss(reference(inputs), labels)
    reference_loss.backward()
    loss = sharded.loss(sharded(inputs), labels)
    loss.backward()
    reduce_tensor_parallel_grads(sharded, state.tp)

    reference_params = dict(reference.named_parameters())
    worst, worst_name, checked = 0.0, "", 0
    for name, param in sharded.named_parameters():
        reference_grad = reference_params[name].grad
        if reference_grad is None:
            assert param.grad is None or torch.all(param.grad == 0), name
            continue
        expected = local_view(reference_grad, param, state.tp.size, state.tp.rank)
        assert param.grad is not None, f"{name}: no gradient"
        assert param.grad.shape == expected.shape, (name, param.grad.shape, expected.shape)
        error = (param.grad - expected).abs().max().item()
        checked += 1
        if error > worst:
            worst, worst_name = error, name
    return {
        "loss": loss.item(),
        "reference_loss": reference_loss.item(),
        "max_grad_error": worst,
        "worst_param": worst_name,
        "checked": checked,
        "traffic": state.counter.snapshot(),
    }


def compare_three_steps(env, payload) -> dict:
    """Parameters after three Per-Head Muon + AdamW steps: TP shards against the single-process model.

    Covers the TP-aware Muon: head-split projections are orthogonalised per head locally, other
    sharded matrices (MLP gate/up/down) are gathered over TP and orthogonalised whole.
    """
    from k3train.optim.builder import build_optimizer
    from k3train.optim.config import OptimizerConfig

    config, state, reference, sharded = _models(env, payload)
    optimizer_config = OptimizerConfig(lr=1e-2)
    reference_optimizer = build_optimizer(reference, optimizer_config)
    sharded_optimizer = build_optimizer(sharded, optimizer_config)
    generator = torch.Generator().manual_seed(5)
    for _ in range(3):
        tokens = torch.randint(0, config.vocab_size, (2, 17), generator=generator)
        for model, optimizer in ((reference, reference_optimizer), (sharded, sharded_optimizer)):
            model.loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
            if model is sharded:
                reduce_tensor_parallel_grads(model, state.tp)
            optimizer.step()
            optimizer.zero_grad()
            model.update_routing_biases(state.tp if model is sharded and state.sequence_parallel else None)
    reference_params = dict(reference.named_parameters())
    worst, worst_name = 0.0, ""
    for name, param in sharded.named_parameters():
        expected = local_view(reference_params[name].detach(), param, state.tp.size, state.tp.rank)
        error = (param.detach() - expected).abs().max().item()
        if error > worst:
            worst, worst_name = error, name
    biases = [moe.gate.e_score_correction_bias for moe in sharded.moe_layers()]
    reference_biases = [moe.gate.e_score_correction_bias for moe in reference.moe_layers()]
    bias_error = max((a - b).abs().max().item() for a, b in zip(biases, reference_biases))
    return {"max_param_error": worst, "worst_param": worst_name, "bias_error": bias_error}


def compare_fused_entry(env, payload) -> list[dict]:
    """`TensorParallel.enter_projections` with overlap (chunks 1, 2, 3: uneven pieces of a
    5-token shard) against `enter` + `F.linear`, with and without sequence parallelism, float64:
    the whole input, the outputs, and the gradients of the input and both weights; and the
    entry's counted bytes (the pieces add up to the unfused collective)."""
    from k3train.parallel.tensor import TensorParallel

    config = small_config()
    state = build_state(env.world_size, env.rank, env.world_size, True, config)
    results = []
    for sequence_parallel in (False, True):
        for chunks in (1, 2, 3):
            generator = torch.Generator().manual_seed(7)
            full_input = torch.randn(2, 10, 6, generator=generator, dtype=torch.float64)
            weights = [torch.randn(rows, 6, generator=generator, dtype=torch.float64) for rows in (4, 3)]
            probes = [torch.randn(2, 10, width, generator=generator, dtype=torch.float64) for width in (6, 4, 3)]
            shard = full_input.chunk(env.world_size, dim=1)[env.rank] if sequence_parallel else full_input
            measured: dict[bool, dict[str, Any]] = {}
            for fused in (True, False):
                tp = TensorParallel(state.tp, sequence_parallel, overlap_chunks=chunks if fused else 0)
                x = shard.clone().requires_grad_(True)
                projections = []
                for weight in weights:
                    linear = torch.nn.Linear(6, weight.shape[0], bias=False, dtype=torch.float64)
                    linear.weight.data.copy_(weight)
                    projections.append(linear)
                state.counter.reset()
                whole, outputs = tp.enter_projections(x, projections)
                loss = sum((tensor * probe).sum() for tensor, probe in zip([whole, *outputs], probes))
                assert isinstance(loss, torch.Tensor)
                loss.backward()
                assert x.grad is not None
                measured[fused] = dict(
                    values=[t.detach() for t in (whole, *outputs)],
                    grads=[x.grad, *(p.weight.grad for p in projections)],
                    bytes=state.counter.bytes.get("tp", 0),
                )
            error = max(
                (a - b).abs().max().item()
                for key in ("values", "grads")
                for a, b in zip(measured[True][key], measured[False][key])
            )
            results.append(
                dict(
                    sequence_parallel=sequence_parallel,
                    chunks=chunks,
                    error=error,
                    bytes=(measured[True]["bytes"], measured[False]["bytes"]),
                )
            )
            results.append(_compare_fused_leave(state, env, sequence_parallel, chunks))
    return results


def _compare_fused_leave(state, env, sequence_parallel: bool, chunks: int) -> dict:
    """`TensorParallel.leave_projection` with overlap against `leave(F.linear(...))`: a
    row-parallel projection of this rank's features of the whole sequence, float64, the output
    and the gradients of the input and the weight, and the counted bytes."""
    from k3train.parallel.tensor import TensorParallel

    generator = torch.Generator().manual_seed(11 + env.rank)  # each rank its own partial input
    features = torch.randn(2, 10, 4, generator=generator, dtype=torch.float64)
    weight = torch.randn(6, 4, generator=generator, dtype=torch.float64)
    shape = (2, 10 // env.world_size if sequence_parallel else 10, 6)
    probe = torch.randn(shape, generator=torch.Generator().manual_seed(5 + env.rank), dtype=torch.float64)
    measured: dict[bool, dict[str, Any]] = {}
    for fused in (True, False):
        tp = TensorParallel(state.tp, sequence_parallel, overlap_chunks=chunks if fused else 0)
        x = features.clone().requires_grad_(True)
        linear = torch.nn.Linear(4, 6, bias=False, dtype=torch.float64)
        linear.weight.data.copy_(weight)
        state.counter.reset()
        out = tp.leave_projection(x, linear)
        (out * probe).sum().backward()
        assert x.grad is not None and linear.weight.grad is not None
        measured[fused] = dict(
            values=[out.detach()], grads=[x.grad, linear.weight.grad], bytes=state.counter.bytes.get("tp", 0)
        )
    error = max(
        (a - b).abs().max().item()
        for key in ("values", "grads")
        for a, b in zip(measured[True][key], measured[False][key])
    )
    return dict(
        leave=True,
        sequence_parallel=sequence_parallel,
        chunks=chunks,
        error=error,
        bytes=(measured[True]["bytes"], measured[False]["bytes"]),
    )
