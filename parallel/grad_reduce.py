"""Data-parallel gradient reduction: which group each parameter's gradient is summed over,
bucketed all-reduces overlapped with backward (`GradientReducer`), the step loss averaged over
DP, and this rank's share of the global gradient norm.

How a training step uses it, and why each parameter reduces where it does:
docs/data_parallel.md ("Gradient reduction", "The global gradient norm"). The ZeRO-1 optimizer
is `k3train.parallel.zero1`.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Mapping, Optional

import torch
import torch.distributed as dist
from torch import nn

from k3train.optim.clip import NormShare, ReduceFn, clip_grad_norm_
from k3train.parallel.comm import Group
from k3train.parallel.state import ParallelState

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
"""Gradient bucket / parameter-exchange chunk size (Megatron's DDP default is 40M elements;
PyTorch DDP's 25 MiB is a middle ground that still overlaps well on small models)."""


# ---------------------------------------------------------------------------------------------
# Parameter markers and the groups they reduce over


def is_expert_parallel(param: torch.Tensor) -> bool:
    """An expert's weights: replicated over `state.expert_dp`, distinct across `state.ep`."""
    return bool(getattr(param, "expert_parallel", False))


def is_sequence_parallel(param: torch.Tensor) -> bool:
    """Replicated across TP, but each TP rank sees a different part of the sequence."""
    return bool(getattr(param, "sequence_parallel", False))


def has_tp_partial_grad(param: torch.Tensor, state: ParallelState) -> bool:
    """Replicated across TP with a gradient each TP rank sees only in part (summed over TP):
    parallel/tensor.py's `tp_partial_grad`, or `sequence_parallel` under sequence parallelism."""
    if state.layout.tp == 1:
        return False
    return bool(getattr(param, "tp_partial_grad", False)) or (is_sequence_parallel(param) and state.sequence_parallel)


def is_tensor_parallel(param: torch.Tensor) -> bool:
    """A TP shard (different values on each TP rank)."""
    return bool(getattr(param, "tensor_parallel", False))


def replica_group(param: torch.Tensor, state: ParallelState) -> Group:
    """The group over which `param` is replicated (and ZeRO-1 picks its owner)."""
    return state.expert_dp if is_expert_parallel(param) else state.dp


@dataclass(frozen=True)
class Reduction:
    """How one parameter's gradient is reduced: SUM over `group`, times `scale`."""

    group: Group
    scale: float

    @property
    def key(self) -> tuple[str, float]:
        return self.group.name, self.scale

    @property
    def is_identity(self) -> bool:
        return self.group.size == 1 and self.scale == 1.0


def gradient_reduction(param: torch.Tensor, state: ParallelState) -> Reduction:
    """The reduction `param`'s gradient needs (why: docs/data_parallel.md)."""
    dp = state.layout.dp
    if is_expert_parallel(param):
        if has_tp_partial_grad(param, state):
            raise ValueError("a parameter cannot be both expert_parallel and tp_partial_grad/sequence_parallel")
        return Reduction(state.expert_dp, 1.0 / dp)
    if has_tp_partial_grad(param, state):
        return Reduction(state.data_tensor, 1.0 / dp)
    return Reduction(state.dp, 1.0 / dp)


def _all_reduce_async(group: Group, tensor: torch.Tensor) -> Optional[dist.Work]:
    """SUM all-reduce of `tensor` over `group`, launched asynchronously and counted like
    comm.py's synchronous collectives (bytes this rank contributes, one message)."""
    if group.size == 1:
        return None
    group.counter.add(group.name, tensor)
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group.process_group, async_op=True)


def _reduce_scatter_async(group: Group, tensor: torch.Tensor, output: torch.Tensor) -> Optional[dist.Work]:
    """SUM reduce-scatter of `tensor` (equal segments, rank order) into `output` over `group`,
    launched asynchronously and counted like comm.py's `reduce_scatter` (its full input, one
    message)."""
    group.counter.add(group.name, tensor)
    return dist.reduce_scatter_single(output, tensor, op=dist.ReduceOp.SUM, group=group.process_group,
                                      async_op=True)


def average_over_dp(value: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """The mean of a per-replica scalar (e.g. the step loss) over DP; a new fp64 tensor, the
    same on every rank (so a NaN guard decides the same everywhere)."""
    total = value.detach().to(torch.float64).clone()
    return state.dp.all_reduce(total) / state.layout.dp


# ---------------------------------------------------------------------------------------------
# Gradient reduction


@dataclass(eq=False)
class GradBucket:
    """Parameters reduced together: one flat buffer, one collective.

    Plain bucket: gradients back to back, then one has-gradient flag per parameter; all-reduced,
    so every rank gets every reduced gradient. Owner-sharded bucket (ZeRO-1, `owners` set): the
    buffer is `group.size` equal segments, segment r holding the gradients of the whole
    parameters rank r owns then their flags (padded to the longest segment); reduce-scattered,
    so each rank gets only its own parameters' reduced gradients.
    """

    index: int
    reduction: Reduction
    dtype: torch.dtype
    """Dtype of the flat buffer (and of the collective)."""
    params: list[nn.Parameter]
    offsets: list[int]
    """Position of each parameter's gradient in the flat buffer."""
    numel: int = 0
    """Gradient elements (without flags and padding)."""
    owners: Optional[list[int]] = None
    """Owner-sharded: each parameter's owner (index in the reduction group); None: all-reduced."""
    segment: int = 0
    """Owner-sharded: elements per rank's segment (gradients + flags + padding)."""
    flag_positions: list[int] = field(default_factory=list)
    """Position of each parameter's has-gradient flag in the flat buffer."""
    # Per-step state, reset by `GradientReducer.finish`.
    pending: set[int] = field(default_factory=set)
    buffer: Optional[torch.Tensor] = None
    result: Optional[torch.Tensor] = None
    """The reduced values this rank receives: the whole buffer, or its segment when sharded."""
    work: Optional[dist.Work] = None
    launched: bool = False

    def reset(self) -> None:
        self.pending = {id(p) for p in self.params}
        self.buffer, self.result, self.work, self.launched = None, None, None, False

    @property
    def sharded(self) -> bool:
        return self.owners is not None

    @property
    def length(self) -> int:
        """Elements of the flat buffer (the collective's input)."""
        return self.reduction.group.size * self.segment if self.sharded else self.numel + len(self.params)

    @property
    def nbytes(self) -> int:
        """Bytes of the collective's input (gradients, flags, padding): what comm.py counts."""
        return self.length * torch.empty((), dtype=self.dtype).element_size()

    def received(self, rank: int) -> list[tuple[nn.Parameter, int, int]]:
        """(parameter, gradient position, flag position) in `result` for the parameters whose
        reduced gradient rank `rank` receives (all of them unless sharded)."""
        if not self.sharded:
            return list(zip(self.params, self.offsets, self.flag_positions))
        base = rank * self.segment
        return [(p, offset - base, flag - base)
                for p, offset, flag, owner in zip(self.params, self.offsets, self.flag_positions, self.owners)
                if owner == rank]

    def shard_by_owner(self, owners: list[int]) -> None:
        """Lay the buffer out as per-owner segments (see the class docstring)."""
        size = self.reduction.group.size
        grads, flags = [0] * size, [0] * size
        for param, owner in zip(self.params, owners):
            grads[owner] += param.numel()
            flags[owner] += 1
        self.segment = max(g + f for g, f in zip(grads, flags))
        filled = [0] * size
        flagged = [0] * size
        self.offsets, self.flag_positions = [], []
        for param, owner in zip(self.params, owners):
            base = owner * self.segment
            self.offsets.append(base + filled[owner])
            self.flag_positions.append(base + grads[owner] + flagged[owner])
            filled[owner] += param.numel()
            flagged[owner] += 1
        self.owners = list(owners)


class GradientReducer:
    """Averages gradients over data parallel in buckets, overlapped with backward.

    Args:
        model: the (local part of the) model; its trainable parameters are bucketed.
        state: the parallel state (`dp`, `expert_dp`, `data_tensor` groups).
        bucket_bytes: target bucket size in bytes of the reduction dtype; a larger parameter
            gets a bucket of its own.
        reduce_dtype: dtype of the flat buffers; default fp32, or the parameter dtype if wider
            (float64 test models reduce in float64).
        overlap: register post-accumulate-grad hooks that launch buckets during backward; with
            False every bucket is reduced in `finish()`.
        owners: ZeRO-1's owner of each parameter (name -> index in its replica group,
            `DistributedOptimizer.gradient_owners()`), or None. With it, a bucket reduced over
            its parameters' replica group is reduce-scattered to the owners (each gets the whole
            gradients of its own parameters, non-owners none: their `p.grad` is None after
            `finish`) whenever that sends fewer bytes than an all-reduce despite the padding of
            uneven segments; see docs/data_parallel.md ("ZeRO-1").

    Build it once the model has its final device and dtype (the hooks sit on the parameter
    objects). Under interleaved pipelining give each model chunk its own reducer, so that each
    reduces after its own last micro-batch.
    """

    def __init__(
        self,
        model: nn.Module,
        state: ParallelState,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        reduce_dtype: Optional[torch.dtype] = None,
        overlap: bool = True,
        owners: Optional[Mapping[str, int]] = None,
    ) -> None:
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.state = state
        self.bucket_bytes = bucket_bytes
        self.reduce_dtype = reduce_dtype
        self.buckets = self._build_buckets(model)
        if owners is not None:
            self._shard_by_owner(model, owners)
        for bucket in self.buckets:
            if not bucket.sharded:
                bucket.flag_positions = [bucket.numel + i for i in range(len(bucket.params))]
        for _, param in model.named_parameters():  # clip_grad_norm's share of owner-only gradients
            param.grad_on_owner_only = False
        for bucket in self.buckets:
            for param in bucket.params:
                param.grad_on_owner_only = bucket.sharded
        self._bucket_of: dict[int, GradBucket] = {id(p): b for b in self.buckets for p in b.params}
        self._sync = True
        self._next_launch = 0
        for bucket in self.buckets:
            bucket.reset()
        self._hooks = []
        if overlap:
            self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready)
                           for b in self.buckets for p in b.params]

    def _build_buckets(self, model: nn.Module) -> list[GradBucket]:
        """Reverse registration order, one open bucket per (reduction, dtype); a bucket closes
        when the next parameter would take it past `bucket_bytes`."""
        buckets: list[GradBucket] = []
        open_buckets: dict[tuple, GradBucket] = {}
        for _, param in reversed(list(model.named_parameters())):
            if not param.requires_grad:
                continue
            reduction = gradient_reduction(param, self.state)
            if reduction.is_identity:
                continue  # nothing to do, e.g. a single process
            dtype = self.reduce_dtype or torch.promote_types(param.dtype, torch.float32)
            key = (reduction.key, dtype)
            bucket = open_buckets.get(key)
            element = torch.empty((), dtype=dtype).element_size()
            if bucket is not None and (bucket.numel + param.numel()) * element > self.bucket_bytes:
                bucket = None
            if bucket is None:
                bucket = GradBucket(len(buckets), reduction, dtype, [], [])
                buckets.append(bucket)
                open_buckets[key] = bucket
            bucket.params.append(param)
            bucket.offsets.append(bucket.numel)
            bucket.numel += param.numel()
        return buckets

    def _shard_by_owner(self, model: nn.Module, owners: Mapping[str, int]) -> None:
        """Reduce-scatter the buckets whose group is their parameters' replica group (the group
        the owners are ranks of) when its padded input is under twice the all-reduced buffer:
        a ring reduce-scatter sends (p-1)/p of its input, an all-reduce 2(p-1)/p of its own."""
        names = {id(param): name for name, param in model.named_parameters()}
        for bucket in self.buckets:
            group = bucket.reduction.group
            if group.size == 1 or any(replica_group(p, self.state).name != group.name for p in bucket.params):
                continue
            if any(names[id(p)] not in owners for p in bucket.params):
                continue
            plain = bucket.numel + len(bucket.params)
            offsets = list(bucket.offsets)
            bucket.shard_by_owner([owners[names[id(p)]] for p in bucket.params])
            if bucket.length >= 2 * plain:  # padding would cost more than the reduce-scatter saves
                bucket.owners, bucket.segment, bucket.offsets = None, 0, offsets

    # ------------------------------------------------------------------ micro-batch switch
    def set_last_micro_batch(self, last: bool) -> None:
        """True (default): the next backward reduces; False: gradients only accumulate."""
        self._sync = last

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally (all but the last micro-batch)."""
        previous = self._sync
        self._sync = False
        try:
            yield
        finally:
            self._sync = previous

    # ------------------------------------------------------------------ reduction
    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self._sync:
            return
        bucket = self._bucket_of[id(param)]
        if bucket.launched:
            # Its gradient changed after the bucket was sent: the reduced value would be stale.
            raise RuntimeError(
                "a parameter received a gradient after its bucket was reduced (a second backward "
                "without finish(), or reentrant checkpointing); wrap all but the last micro-batch "
                "in no_sync() and call finish() after the last one"
            )
        bucket.pending.discard(id(param))
        self._launch_ready()

    def _launch_ready(self) -> None:
        """Launch every ready bucket that all earlier buckets precede (same order on every rank)."""
        while self._next_launch < len(self.buckets) and not self.buckets[self._next_launch].pending:
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1

    def _launch(self, bucket: GradBucket) -> None:
        buffer = torch.zeros(bucket.length, dtype=bucket.dtype, device=bucket.params[0].device)
        for param, offset in zip(bucket.params, bucket.offsets):
            if param.grad is not None:  # an unused parameter contributes zeros (and flag 0)
                buffer[offset:offset + param.numel()].copy_(param.grad.reshape(-1))
        flags = torch.tensor([float(param.grad is not None) for param in bucket.params], dtype=bucket.dtype)
        positions = torch.tensor(bucket.flag_positions, dtype=torch.long)
        buffer[positions.to(buffer.device)] = flags.to(buffer.device)
        if bucket.reduction.scale != 1.0:
            buffer.mul_(bucket.reduction.scale)  # before the sum, as Megatron: no fp16/bf16 overflow
        bucket.buffer = buffer
        group = bucket.reduction.group
        if bucket.sharded:
            bucket.result = buffer.new_empty(bucket.segment)
            bucket.work = _reduce_scatter_async(group, buffer, bucket.result)
        else:
            bucket.result = buffer
            bucket.work = _all_reduce_async(group, buffer)
        bucket.launched = True

    def finish(self) -> None:
        """Reduce what backward has not launched yet, wait for everything and write the reduced
        gradients into `p.grad` (in the parameter's dtype); then ready for the next step."""
        for bucket in self.buckets[self._next_launch:]:
            self._launch(bucket)
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
        if not self.buckets:
            return
        received = [bucket.received(bucket.reduction.group.rank) for bucket in self.buckets]
        # One host read of every flag (one device synchronisation per step, not per bucket).
        flag_tensors = [bucket.result[[flag for _, _, flag in mine]] for bucket, mine in zip(self.buckets, received)
                        if mine]
        flags = torch.cat(flag_tensors).tolist() if flag_tensors else []
        position = 0
        for bucket, mine in zip(self.buckets, received):
            if bucket.sharded:  # the owners hold these gradients; this rank needs none of the others'
                kept = {id(param) for param, _, _ in mine}
                for param in bucket.params:
                    if id(param) not in kept:
                        param.grad = None
            for param, offset, _ in mine:
                has_grad = flags[position] != 0.0
                position += 1
                if not has_grad:
                    param.grad = None  # no rank has a gradient for it: None, as in one process
                    continue
                reduced = bucket.result[offset:offset + param.numel()].view(param.shape)
                if param.grad is None:
                    param.grad = reduced.to(param.dtype).clone()
                else:
                    param.grad.copy_(reduced)
            bucket.reset()
        self._next_launch = 0

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    # ------------------------------------------------------------------ reporting
    def bytes_per_step(self) -> dict[str, int]:
        """Bytes this rank contributes per step, per group name (what `state.counter` counts)."""
        out: dict[str, int] = defaultdict(int)
        for bucket in self.buckets:
            if bucket.reduction.group.size > 1:
                out[bucket.reduction.group.name] += bucket.nbytes
        return dict(out)

    def describe(self) -> str:
        per_group: dict[str, list[GradBucket]] = defaultdict(list)
        for bucket in self.buckets:
            per_group[bucket.reduction.group.name].append(bucket)
        parts = [f"{name}: {len(bs)} buckets ({sum(b.sharded for b in bs)} reduce-scattered to their owners), "
                 f"{sum(b.numel for b in bs) / 1e6:.3g}M elements, {sum(b.nbytes for b in bs) / 2**20:.3g} MiB"
                 for name, bs in per_group.items()]
        return "gradient reduction: " + ("; ".join(parts) if parts else "none (no replicas)")


# ---------------------------------------------------------------------------------------------
# This rank's share of the global gradient norm (computed by k3train.optim.clip)


def counts_in_norm(param: torch.Tensor, state: ParallelState) -> bool:
    """Whether this rank counts `param`'s gradient in the global norm: TP shards and expert
    weights always (distinct across the ranks they are summed over), TP-replicated parameters
    only on tp_rank 0 (else they would count tp times). After `GradientReducer.finish` an
    all-reduced gradient is identical across DP, so no rank of `dp` adds anything new; a
    reduce-scattered one (`grad_on_owner_only`) exists on its owner alone."""
    return is_tensor_parallel(param) or is_expert_parallel(param) or state.tp_rank == 0


def is_owner_only(param: torch.Tensor) -> bool:
    """Its gradient was reduce-scattered to its ZeRO-1 owner (`GradientReducer(owners=...)`)."""
    return bool(getattr(param, "grad_on_owner_only", False))


def norm_shares(state: ParallelState, owner_only: bool = False) -> list[NormShare]:
    """The partial sums of a stage: all-reduced dense gradients counted once, summed over TP;
    all-reduced expert gradients (whole experts, distinct across EP), summed over EP; with
    `owner_only` (the stage has reduce-scattered buckets), the gradients only their owners hold,
    counted once per TP column as above and summed over `data_tensor` (every dp × tp rank of the
    stage, which spans the owners of both the dense and the expert parameters). Every rank of a
    stage runs the same reductions (the EP one is free when ep == 1), so the collectives match
    whatever parameters a rank holds."""
    shares = [NormShare(lambda p: not is_owner_only(p) and not is_expert_parallel(p) and counts_in_norm(p, state),
                        _sum_over(state.tp)),
              NormShare(lambda p: not is_owner_only(p) and is_expert_parallel(p), _sum_over(state.ep))]
    if owner_only:
        shares.append(NormShare(lambda p: is_owner_only(p) and counts_in_norm(p, state), _sum_over(state.data_tensor)))
    return shares


def _sum_over(group: Group) -> ReduceFn:
    """SUM all-reduce over `group` (in place, returns the tensor; nothing when size 1)."""
    return lambda tensor: group.all_reduce(tensor)


def clip_grad_norm(parameters: Iterable[torch.Tensor], max_norm: float, state: ParallelState) -> torch.Tensor:
    """Clip every local gradient by the global norm over the whole model,
    `pp.SUM(tp.SUM(dense counted once) + ep.SUM(expert) [+ data_tensor.SUM(owner-only)])`;
    returns that norm (before clipping, the same on every rank). `max_norm <= 0` (or inf) only
    measures. The norm itself is `k3train.optim.clip.clip_grad_norm_`'s: this only supplies the
    shares and the PP sum."""
    parameters = list(parameters)
    shares = norm_shares(state, owner_only=any(is_owner_only(p) for p in parameters))
    return clip_grad_norm_(parameters, max_norm, reduce_squared_norm=_sum_over(state.pp), shares=shares)
