"""Mixed precision with sharded fp32 master weights (Megatron's distributed optimizer): the model
holds bf16 weights; each parameter's gradient accumulates over the micro-batches in a persistent
buffer of the gradient dtype (`main_grad`, a view of its bucket's buffer, fp32 by default), is
reduced in that buffer (reduce-scattered to its ZeRO-1 owner where the bucket is sharded), and
only the owner keeps an fp32 master copy of the parameter and its optimizer state. The owner
steps the master, rounds it into the bf16 weight, and ZeRO-1's exchange all-gathers the bf16
weights.

Why and how the pieces fit: docs/precision.md ("Master weights").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol, cast

import torch
from torch import nn

from k3train.parallel.grad_reduce import (
    DEFAULT_BUCKET_BYTES,
    GradBucket,
    GradientReducer,
    replica_group,
)
from k3train.parallel.state import ParallelState


class MainGradMark(Protocol):
    """The attribute `MainGradReducer` sets on every trainable parameter (torch does not declare
    it): the parameter-shaped view of the persistent buffer its gradients accumulate in."""

    main_grad: torch.Tensor


class OwnerOnlyMaster(Protocol):
    grad_on_owner_only: bool


def main_grad_of(param: torch.Tensor) -> torch.Tensor:
    return cast(MainGradMark, param).main_grad


class MainGradReducer(GradientReducer):
    """`GradientReducer` whose buckets are persistent buffers of `grad_dtype` that the gradients
    accumulate in (Megatron's grad buffer): after each backward the hook adds the parameter's
    (bf16) gradient into its `main_grad` view and frees it, so autograd's gradient lives only
    between a parameter's accumulation and its hook; the reduction runs in the buffer itself (a
    sharded bucket's reduced segment is copied back into the owner's part of it). Parameters that
    need no reduction get views of one more buffer. After `finish`, `reduced_gradient(param)` is
    the reduced gradient in `grad_dtype` (None where no rank had one or this rank does not own it
    in a sharded bucket); `zero_main_grads` clears the buffers for the next step.

    Memory: the buffers (each bucket's `length` elements: gradients, one flag per parameter and
    the padding of sharded segments) plus, while a sharded bucket is in flight, its segment.
    """

    def __init__(
        self,
        model: nn.Module,
        state: ParallelState,
        grad_dtype: torch.dtype,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        overlap: bool = True,
        owners: Mapping[str, int] | None = None,
    ) -> None:
        super().__init__(model, state, bucket_bytes=bucket_bytes, reduce_dtype=grad_dtype, overlap=False, owners=owners)
        self.grad_dtype = grad_dtype
        self.overlap = overlap
        self._storage: list[torch.Tensor] = []
        self._flag_position: dict[int, int] = {}
        for bucket in self.buckets:
            device = bucket.params[0].device
            storage = torch.zeros(bucket.length, dtype=grad_dtype, device=device)
            self._storage.append(storage)
            for param, offset, flag in zip(bucket.params, bucket.offsets, bucket.flag_positions):
                cast(MainGradMark, param).main_grad = storage[offset : offset + param.numel()].view(param.shape)
                self._flag_position[id(param)] = flag
        in_buckets = {id(p) for bucket in self.buckets for p in bucket.params}
        self.local_params = [p for p in model.parameters() if p.requires_grad and id(p) not in in_buckets]
        self.local_storage: torch.Tensor | None = None
        if self.local_params:
            self.local_storage = torch.zeros(
                sum(p.numel() for p in self.local_params), dtype=grad_dtype, device=self.local_params[0].device
            )
            offset = 0
            for param in self.local_params:
                view = self.local_storage[offset : offset + param.numel()].view(param.shape)
                cast(MainGradMark, param).main_grad = view
                offset += param.numel()
        self._local_has_grad: set[int] = set()
        self._reduced: dict[int, bool] = {}
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._accumulate) for p in model.parameters() if p.requires_grad
        ]

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the persistent gradient buffers (what the planner counts as gradients)."""
        element = torch.empty((), dtype=self.grad_dtype).element_size()
        local = self.local_storage.numel() if self.local_storage is not None else 0
        return (sum(s.numel() for s in self._storage) + local) * element

    @torch.no_grad()
    def _accumulate(self, param: torch.Tensor) -> None:
        grad = param.grad
        if grad is None:
            return
        main_grad_of(param).add_(grad)
        param.grad = None  # the bf16 copy is freed at once: only the buffer holds gradients
        bucket = self._bucket_of.get(id(param))
        if bucket is None:
            self._local_has_grad.add(id(param))
            return
        self._storage[bucket.index][self._flag_position[id(param)]] = 1
        if self.overlap:
            self._on_grad_ready(param)

    def _launch(self, bucket: GradBucket) -> None:
        storage = self._storage[bucket.index]
        if bucket.reduction.scale != 1.0:
            storage.mul_(bucket.reduction.scale)  # before the sum, as Megatron: no bf16 overflow
        bucket.buffer = storage
        if bucket.sharded:
            bucket.result = storage.new_empty(bucket.segment)
            bucket.work = bucket.owner_group.reduce_scatter_async(storage, bucket.result)
        else:
            bucket.result = storage
            bucket.work = bucket.reduction.group.all_reduce_async(storage)
        bucket.launched = True

    def finish(self) -> None:
        """Reduce what backward has not launched, wait, and record which parameters this rank
        holds a reduced gradient of (in their `main_grad`)."""
        for bucket in self.buckets[self._next_launch :]:
            self._launch(bucket)
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
            if bucket.then_over is not None:
                bucket.then_over.all_reduce(bucket.launched_result)
        received = [bucket.received((bucket.scatter_group or bucket.reduction.group).rank) for bucket in self.buckets]
        flag_tensors = [
            bucket.launched_result[[flag for _, _, flag in mine]]
            for bucket, mine in zip(self.buckets, received)
            if mine
        ]
        flags = torch.cat(flag_tensors).tolist() if flag_tensors else []  # one host read per step
        position = 0
        for bucket, mine in zip(self.buckets, received):
            if bucket.sharded:  # the owner's reduced segment back into its part of the buffer
                group = bucket.owner_group
                start = group.rank * bucket.segment
                self._storage[bucket.index][start : start + bucket.segment].copy_(bucket.launched_result)
            for param, _, _ in mine:
                self._reduced[id(param)] = flags[position] != 0.0
                position += 1
            bucket.reset()
        for param in self.local_params:
            self._reduced[id(param)] = id(param) in self._local_has_grad
        self._next_launch = 0

    def reduced_gradient(self, param: torch.Tensor) -> torch.Tensor | None:
        """`param`'s reduced gradient (a view of the buffer, `grad_dtype`) after `finish`, or None."""
        return main_grad_of(param) if self._reduced.get(id(param), False) else None

    @torch.no_grad()
    def zero_main_grads(self) -> None:
        for storage in self._storage:
            storage.zero_()
        if self.local_storage is not None:
            self.local_storage.zero_()
        self._local_has_grad.clear()
        self._reduced.clear()


class MasterWeights:
    """fp32 masters of the parameters this rank owns (all of them without ZeRO-1), carrying the
    model parameters' marks (head blocks, TP shard and group, expert flags), so Per-Head Muon
    orthogonalises each whole matrix or head from its master exactly as it would the fp32
    parameter. Built from the model's fp32 initialisation before the model is cast to
    `model_dtype`, so the masters start from the exact initial values."""

    def __init__(
        self,
        named_owned: Iterable[tuple[str, nn.Parameter]],
        state: ParallelState,
        zero1: bool,
        master_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.pairs: list[tuple[str, nn.Parameter, nn.Parameter]] = []
        for name, param in named_owned:
            master = nn.Parameter(param.detach().to(master_dtype).clone(), requires_grad=param.requires_grad)
            master.__dict__.update(param.__dict__)  # the marks Muon, clipping and checkpoints read
            # Under ZeRO-1 a master exists on its owner alone, whatever its bucket did: its
            # gradient counts in the norm once, over the stage's data × tensor ranks.
            cast(OwnerOnlyMaster, master).grad_on_owner_only = zero1 and replica_group(param, state).size > 1
            self.pairs.append((name, param, master))
        self.master_of = {id(param): master for _, param, master in self.pairs}
        self.by_name = {name: master for name, _, master in self.pairs}

    @property
    def masters(self) -> list[nn.Parameter]:
        return [master for _, _, master in self.pairs]

    @torch.no_grad()
    def take_gradients(self, reducer: MainGradReducer) -> list[nn.Parameter]:
        """Each master's gradient: its parameter's reduced gradient in fp32 (a view of the
        buffer when that is fp32), plus what arrived in `param.grad` after the reduction (the
        balanced expert dispatcher's replica gradients); returns the masters."""
        for _, param, master in self.pairs:
            reduced = reducer.reduced_gradient(param)
            late = param.grad
            if reduced is None and late is None:
                master.grad = None
                continue
            grad = reduced.to(master.dtype) if reduced is not None else torch.zeros_like(master)
            if late is not None:
                grad = grad + late.to(master.dtype)
            master.grad = grad
        return self.masters

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Round each stepped master into its model parameter (before ZeRO-1's exchange)."""
        for _, param, master in self.pairs:
            param.data.copy_(master.data)

    @torch.no_grad()
    def copy_from_model(self, names: Iterable[str]) -> None:
        """Masters of `names` from the model's weights (a checkpoint without masters)."""
        wanted = set(names)
        for name, param, master in self.pairs:
            if name in wanted:
                master.data.copy_(param.data)

    def zero_grad(self) -> None:
        for master in self.masters:
            master.grad = None


def cast_trainable_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """The model's trainable floating-point parameters in `dtype`, in place (the same Parameter
    objects: names, marks and the optimizer's references stay)."""
    for param in model.parameters():
        if param.requires_grad and param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)


__all__ = ["MainGradReducer", "MasterWeights", "cast_trainable_parameters", "main_grad_of"]
