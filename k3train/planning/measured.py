"""One small layout's job built in this process, as `pretrain_k3.main` builds it, and measured:
what the planner predicts is checked against these runs (`tools/plan.py --validate`, the traffic
and mixed-precision tests).

`layout_overrides` turns a layout (`tp`, `dp`, `pp`, `ep`, `sequence_parallel`, `zero1`, extra
`overrides`) into recipe overrides; `build_trainer` builds the rank's job (`build_rank`, data,
`Trainer`) without run directory or logger; `measured_memory_step` runs one step and counts what
the rank holds (weights, gradient buffers, fp32 masters, optimizer state) and the bytes autograd
saves in forward.
"""

from __future__ import annotations

from typing import Any

import torch

from k3train.data import build_data
from k3train.model.flops import training_flops_per_token
from k3train.parallel.mixed_precision import main_grad_of
from k3train.parallel.state import ParallelState
from k3train.training.build import build_rank
from k3train.training.loop import Trainer
from k3train.training.throughput import PeakFlops


def layout_batching(layout: dict[str, Any], micro_batch_size: int, micro_batches: int) -> tuple[int, int]:
    """(micro-batch size, micro-batches per DP rank) of `layout`: the ones given, or the layout's
    own `micro_batch_size` with as many tokens per rank (the alternating halves,
    `parallel.ep_overlap_halves`, need two sequences per micro-batch)."""
    size = layout.get("micro_batch_size", micro_batch_size)
    return size, max(1, micro_batch_size * micro_batches // size)


def layout_overrides(layout: dict[str, Any], micro_batch_size: int, micro_batches: int, seq_length: int) -> list[str]:
    """Recipe overrides for one layout: sizes, and a global batch of `micro_batches` per DP rank."""
    dp = layout.get("dp", 1)
    return [
        f"parallel.tp={layout.get('tp', 1)}",
        f"parallel.dp={dp}",
        f"parallel.pp={layout.get('pp', 1)}",
        f"parallel.ep={layout.get('ep', 1)}",
        f"parallel.sequence_parallel={str(layout.get('sequence_parallel', False)).lower()}",
        f"parallel.zero1={str(layout.get('zero1', True)).lower()}",
        f"data.seq_length={seq_length}",
        f"train.micro_batch_size={micro_batch_size}",
        f"train.global_batch_size={micro_batch_size * micro_batches * dp}",
        "train.device=cpu",
        "train.steps=1",
        "train.eval_interval=0",
        "schedule.warmup_steps=1",
        *layout.get("overrides", []),
    ]


def build_trainer(
    config, state: ParallelState, peak: PeakFlops | None = None, device: torch.device = torch.device("cpu")
) -> Trainer:
    """The job of `pretrain_k3.main` on this rank (`build_rank`, data, `Trainer`), without run
    directory or logger; `peak` only scales the MFU it reports."""
    torch.manual_seed(config.train.seed)
    job = build_rank(config, state, device)
    data = build_data(config.data, config.train.global_batch_size, config.train.steps, config.model.vocab_size)
    return Trainer(
        config,
        job.model,
        job.optimizer,
        data,
        device,
        training_flops_per_token(config.model, config.data.seq_length).total,
        peak or PeakFlops(1.0, "MFU"),
        None,
        state,
        job.reducer,
        job.schedule,
    )


def storages_bytes(tensors) -> tuple[int, set[tuple[int, int]]]:
    """The bytes of the distinct storages behind `tensors`, and their keys (pointer, size)."""
    keys = {(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in tensors}
    return sum(nbytes for _, nbytes in keys), keys


def measured_memory_step(trainer: Trainer) -> tuple[dict[str, Any], dict[str, float]]:
    """One training step with every tensor autograd saves outside backward counted once (the
    parameters, masters, gradient buffers and optimizer state excluded), and what the rank holds:
    `{weights, gradients, master, optimizer, activations}` in bytes. With one micro-batch per
    step the saved bytes are that micro-batch's (a storage freed and reused by a later
    micro-batch is counted once)."""
    model, optimizer = trainer.model, trainer.optimizer
    masters = optimizer.master_weights.masters if optimizer.master_weights is not None else []
    params = list(model.parameters())
    weights, weight_keys = storages_bytes([*params, *model.buffers()])
    grads, grad_keys = storages_bytes([main_grad_of(p) for p in params if p.requires_grad])
    master, master_keys = storages_bytes(masters)
    seen = weight_keys | grad_keys | master_keys
    saved = [0]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if torch._C._current_graph_task_id() != -1:  # a recomputation inside backward
            return tensor
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key not in seen:
            seen.add(key)
            saved[0] += storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        metrics = trainer.train_step()
    state_tensors = [
        value
        for per_param in optimizer.optimizer.state.values()
        for value in per_param.values()
        if isinstance(value, torch.Tensor) and value.ndim > 0
    ]
    state_bytes, _ = storages_bytes(state_tensors) if state_tensors else (0, set())
    memory = dict(weights=weights, gradients=grads, master=master, optimizer=state_bytes, activations=saved[0])
    return metrics, {name: float(value) for name, value in memory.items()}


__all__ = ["layout_overrides", "build_trainer", "storages_bytes", "measured_memory_step"]
