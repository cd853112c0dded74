"""Worker side of the mixed-precision checks (`test_mixed_precision.py`): per layout, the job of
`pretrain_k3.main` (`build_rank`, data, `Trainer`) trains a few steps in fp32 and again with
bf16 weights and fp32 master shards from the same seed and batches; the second run's first step
measures what the rank holds (weights, gradient buffers, masters, optimizer state, the bytes
autograd saves in forward) beside the planner's prediction for the same rank."""

from __future__ import annotations

from typing import Any

import torch

from k3train.config import load_config
from k3train.parallel.grad_reduce import replica_group
from k3train.parallel.state import ParallelState, layout_of
from k3train.planning.measured import build_trainer, layout_overrides, measured_memory_step
from k3train.planning.memory import rank_memory
from k3train.training.build import build_planning_rank

MIXED = ["train.precision=bf16", "train.weights=bf16_with_fp32_master_shards"]


def _checks(trainer, state: ParallelState) -> dict[str, Any]:
    """After training: the model's weights are bf16, each owned one equal to its master rounded;
    the masters fp32 and on their owners only; replicas of a parameter identical (exchanged)."""
    optimizer = trainer.optimizer
    named = dict(trainer.model.named_parameters())
    pairs = optimizer.master_weights.pairs
    rounded = all(torch.equal(param.detach(), master.detach().to(param.dtype)) for _, param, master in pairs)
    owners_only = all(
        optimizer.plan.owners[name] == replica_group(named[name], state).rank for name, _, _ in pairs
    ) and sorted(name for name, _, _ in pairs) == sorted(optimizer.owned_parameter_names())
    replicas_equal = True
    for _, param in sorted(named.items()):
        group = replica_group(param, state)
        if group.size > 1:
            gathered = group.all_gather(param.detach().float().reshape(1, -1))
            replicas_equal &= bool((gathered == gathered[0]).all())
    return dict(
        model_dtypes=sorted({str(p.dtype) for p in named.values()}),
        master_dtypes=sorted({str(m.dtype) for _, _, m in pairs}),
        rounded=rounded,
        owners_only=owners_only,
        replicas_equal=replicas_equal,
        owned=len(pairs),
        parameters=len(named),
    )


def train_layouts(env, payload: dict[str, Any]) -> list[dict[str, Any]]:
    results = []
    for layout in payload["layouts"]:
        overrides = layout_overrides(layout, payload["micro_batch_size"], 1, payload["seq_length"])
        runs: dict[str, Any] = {"name": layout["name"]}
        for name, extra in (("fp32", []), ("mixed", MIXED)):
            config = load_config(payload["recipe"], [*overrides, f"train.steps={payload['steps']}", *extra])
            p = config.parallel
            m = config.model
            grid = layout_of(env.world_size, p, m)
            state = ParallelState(grid, env.rank, sequence_parallel=p.sequence_parallel)
            trainer = build_trainer(config, state)
            losses = []
            if name == "mixed":
                metrics, measured = measured_memory_step(trainer)
                losses.append(metrics["loss"])
                predicted = rank_memory(build_planning_rank(config, grid, env.rank), grid, 1)
                runs["measured"] = measured
                runs["predicted"] = dict(
                    weights=predicted.weights,
                    gradients=predicted.gradients,
                    master=predicted.master,
                    optimizer=predicted.optimizer,
                    activations=predicted.activations,
                    pipeline_blocks=predicted.pipeline_blocks,
                    expert_buffers=predicted.expert_buffers,
                )
            while len(losses) < payload["steps"]:
                losses.append(trainer.train_step()["loss"])
            runs[name] = losses
            if name == "mixed":
                runs["checks"] = _checks(trainer, state)
        results.append(runs)
    return results
