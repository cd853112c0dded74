"""Data-parallel gradient reduction: which group each parameter's gradient is summed over,
bucketed all-reduces overlapped with backward (`GradientReducer`) and the step loss averaged over
DP. This rank's share of the global gradient norm is `k3train.parallel.grad_norm`.

How a training step uses it, and why each parameter reduces where it does:
docs/data_parallel.md ("Gradient reduction", "The global gradient norm"). The ZeRO-1 optimizer
is `k3train.parallel.zero1`.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol, cast

import torch
from torch import nn

from k3train.parallel.comm import Group, TimedWork
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


def owner_scatter(param: torch.Tensor, state: ParallelState) -> tuple[Group, Group | None] | None:
    """How `param`'s gradient reaches its ZeRO-1 owner alone: (the group to reduce-scatter over,
    the group the owner's segment is then all-reduced over, or None). A gradient summed over its
    replica group (`dp`, or `expert_dp` for experts) is reduce-scattered over it; a TP-partial
    gradient (summed over `data_tensor` = dp × tp of the stage; its owner is a dp rank, and every
    TP rank of that dp rank steps it) is reduce-scattered over `dp`, then its owner's segment is
    all-reduced over `tp` (each TP rank still holds a partial sum): the same sum in another order.
    None when nothing needs reducing or the replica group has a single rank."""
    reduction = gradient_reduction(param, state)
    replicas = replica_group(param, state)
    if reduction.group.size == 1 or replicas.size == 1:
        return None
    if reduction.group.name == replicas.name:
        return replicas, None
    if reduction.group.name == state.data_tensor.name and replicas.name == state.dp.name:
        return replicas, state.tp
    return None


def row_class(param: torch.Tensor, state: ParallelState) -> tuple | None:
    """What parameters must share for one ZeRO-1 owner row (see `owner_rows`): their reduction
    (group and scale), dtype and element count; None when `param`'s gradient cannot be
    reduce-scattered to its owner (`owner_scatter`)."""
    if owner_scatter(param, state) is None:
        return None
    return gradient_reduction(param, state).key, param.dtype, param.numel()


def owner_rows(
    named_params: Iterable[tuple[str, nn.Parameter]], owners: Mapping[str, int], state: ParallelState
) -> list[list[tuple[str, nn.Parameter]]]:
    """ZeRO-1 owner rows: groups of `p` parameters (p = their replica group's size) of one
    `row_class`, one owned by each rank of the group, in rank order. A bucket of whole rows
    reduce-scatters with no padding at all: every rank's segment holds one parameter of each row,
    all of the same length. Formed from `owners` alone (per class and owner, the parameters in
    the order given, the i-th of every owner making row i), so any plan works; the ownership plan
    (`zero1.plan_ownership`) assigns owners so that nearly every parameter is in a row. The
    order given is the reducer's (reverse registration, about backward's); rows come out in the
    order of their last-ready parameter."""
    named = list(named_params)
    position = {id(param): i for i, (_, param) in enumerate(named)}
    classes: dict[tuple, dict[int, list[tuple[str, nn.Parameter]]]] = defaultdict(lambda: defaultdict(list))
    sizes: dict[tuple, int] = {}
    for name, param in named:
        key = row_class(param, state)
        if key is None or name not in owners:
            continue
        classes[key][owners[name]].append((name, param))
        sizes[key] = replica_group(param, state).size
    rows = []
    for key, per_owner in classes.items():
        count = min(len(per_owner.get(rank, [])) for rank in range(sizes[key]))
        rows += [[per_owner[rank][i] for rank in range(sizes[key])] for i in range(count)]
    rows.sort(key=lambda row: max(position[id(param)] for _, param in row))
    return rows


def average_over_dp(value: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """The mean of a per-replica scalar (e.g. the step loss) over DP; a new fp64 tensor, the
    same on every rank (so a NaN guard decides the same everywhere)."""
    total = value.detach().to(torch.float64).clone()
    return state.dp.all_reduce(total) / state.layout.dp


# ---------------------------------------------------------------------------------------------
# Gradient reduction


class OwnerOnlyMark(Protocol):
    """The mark `GradientReducer` sets on every parameter (an attribute torch does not declare):
    whether its gradient is reduce-scattered to its ZeRO-1 owner alone (`grad_norm.is_owner_only`)."""

    grad_on_owner_only: bool


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
    owners: list[int] | None = None
    """Owner-sharded: each parameter's owner (index in `scatter_group`); None: all-reduced."""
    scatter_group: Group | None = None
    """Owner-sharded: the group reduce-scattered over (the parameters' replica group)."""
    then_over: Group | None = None
    """Owner-sharded TP-partial gradients: the group the owner's segment is then all-reduced over
    (`tp`); None otherwise (`owner_scatter`)."""
    segment: int = 0
    """Owner-sharded: elements per rank's segment (gradients + flags + padding)."""
    flag_positions: list[int] = field(default_factory=list)
    """Position of each parameter's has-gradient flag in the flat buffer."""
    # Per-step state, reset by `GradientReducer.finish`.
    pending: set[int] = field(default_factory=set)
    buffer: torch.Tensor | None = None
    result: torch.Tensor | None = None
    """The reduced values this rank receives: the whole buffer, or its segment when sharded."""
    work: TimedWork | None = None
    launched: bool = False

    def reset(self) -> None:
        self.pending = {id(p) for p in self.params}
        self.buffer, self.result, self.work, self.launched = None, None, None, False

    @property
    def sharded(self) -> bool:
        return self.owners is not None

    @property
    def launched_result(self) -> torch.Tensor:
        """`result` of a launched bucket."""
        assert self.result is not None, "the bucket has not been launched this step"
        return self.result

    @property
    def owner_group(self) -> Group:
        """Owner-sharded: `scatter_group` (`shard_by_owner` sets it with `owners`)."""
        assert self.scatter_group is not None, "not an owner-sharded bucket"
        return self.scatter_group

    @property
    def length(self) -> int:
        """Elements of the flat buffer (the collective's input)."""
        return self.owner_group.size * self.segment if self.sharded else self.numel + len(self.params)

    @property
    def nbytes(self) -> int:
        """Bytes of the collective's input (gradients, flags, padding): what comm.py counts."""
        return self.length * torch.empty((), dtype=self.dtype).element_size()

    def sent(self) -> dict[str, tuple[int, int]]:
        """{group name: (bytes, messages)} this bucket's collectives count on every rank of it,
        per step: the all-reduce, or the reduce-scatter and (TP-partial) the segment's all-reduce."""
        element = torch.empty((), dtype=self.dtype).element_size()
        if not self.sharded:
            group = self.reduction.group
            return {group.name: (self.nbytes, 1)} if group.size > 1 else {}
        out = {self.owner_group.name: (self.nbytes, 1)}
        if self.then_over is not None and self.then_over.size > 1:
            out[self.then_over.name] = (self.segment * element, 1)
        return out

    def wire_bytes(self) -> dict[str, float]:
        """{group name: bytes} one rank puts on the wire per step for this bucket in a ring
        (an all-reduce 2(p-1)/p of its input, a reduce-scatter (p-1)/p): what the time model uses."""
        element = torch.empty((), dtype=self.dtype).element_size()
        if not self.sharded:
            p = self.reduction.group.size
            return {self.reduction.group.name: 2 * (p - 1) / p * self.nbytes} if p > 1 else {}
        p = self.owner_group.size
        out = {self.owner_group.name: (p - 1) / p * self.nbytes}
        if self.then_over is not None and self.then_over.size > 1:
            q = self.then_over.size
            out[self.then_over.name] = 2 * (q - 1) / q * self.segment * element
        return out

    def received(self, rank: int) -> list[tuple[nn.Parameter, int, int]]:
        """(parameter, gradient position, flag position) in `result` for the parameters whose
        reduced gradient rank `rank` receives (all of them unless sharded)."""
        if self.owners is None:  # not sharded
            return list(zip(self.params, self.offsets, self.flag_positions))
        base = rank * self.segment
        return [
            (p, offset - base, flag - base)
            for p, offset, flag, owner in zip(self.params, self.offsets, self.flag_positions, self.owners)
            if owner == rank
        ]

    def shard_by_owner(self, owners: list[int], scatter_group: Group, then_over: Group | None = None) -> None:
        """Lay the buffer out as per-owner segments of `scatter_group` (see the class docstring)."""
        self.scatter_group, self.then_over = scatter_group, then_over
        size = scatter_group.size
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
        reduce_dtype: torch.dtype | None = None,
        overlap: bool = True,
        owners: Mapping[str, int] | None = None,
    ) -> None:
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.state = state
        self.bucket_bytes = bucket_bytes
        self.reduce_dtype = reduce_dtype
        self.buckets = self._build_buckets(model, owners)
        for bucket in self.buckets:
            if not bucket.sharded:
                bucket.flag_positions = [bucket.numel + i for i in range(len(bucket.params))]
        for _, param in model.named_parameters():  # clip_grad_norm's share of owner-only gradients
            cast(OwnerOnlyMark, param).grad_on_owner_only = False
        for bucket in self.buckets:
            for param in bucket.params:
                cast(OwnerOnlyMark, param).grad_on_owner_only = bucket.sharded
        self._bucket_of: dict[int, GradBucket] = {id(p): b for b in self.buckets for p in b.params}
        self._sync = True
        self._next_launch = 0
        for bucket in self.buckets:
            bucket.reset()
        self._hooks = []
        if overlap:
            self._hooks = [
                p.register_post_accumulate_grad_hook(self._on_grad_ready) for b in self.buckets for p in b.params
            ]

    def _build_buckets(self, model: nn.Module, owners: Mapping[str, int] | None) -> list[GradBucket]:
        """Without owners: reverse registration order, one open bucket per (reduction, dtype); a
        bucket closes when the next parameter would take it past `bucket_bytes`. With owners
        (ZeRO-1): the owner rows (`owner_rows`) are packed the same way, whole rows at a time, into
        reduce-scattered buckets with no padding; the parameters in no row are packed as without
        owners, and such a bucket is reduce-scattered too when its padded segments stay under
        twice its plain size (`_shard_by_owner`). Buckets are launched in the order their last
        parameter becomes ready (reverse registration order of their earliest parameter), the
        same order on every rank."""
        named = [
            (name, param)
            for name, param in reversed(list(model.named_parameters()))
            if param.requires_grad and not gradient_reduction(param, self.state).is_identity
        ]
        position = {id(param): i for i, (_, param) in enumerate(named)}
        rows = owner_rows(named, owners, self.state) if owners is not None else []
        in_rows = {id(param) for row in rows for _, param in row}
        rest = [param for _, param in named if id(param) not in in_rows]
        if owners is None:
            buckets = self._pack([[param] for param in rest])
        else:
            # The parameters in no row that could go to their owners are pooled (one bucket per
            # reduction and dtype, whatever its size): the segments even out over the pool where
            # a bucket-size slice of it would be one or two owners' padded to all.
            names = {id(param): name for name, param in named}
            pooled = [param for param in rest if names[id(param)] in owners and owner_scatter(param, self.state)]
            buckets = self._pack([[param] for param in rest if not any(param is q for q in pooled)])
            pools = self._pack([[param] for param in pooled], bucket_bytes=None)
            self._shard_by_owner(pools, names, owners)
            unsharded = [param for bucket in pools if not bucket.sharded for param in bucket.params]
            buckets += [bucket for bucket in pools if bucket.sharded] + self._pack([[param] for param in unsharded])
        row_buckets = self._pack([[param for _, param in row] for row in rows])
        owner_of = {id(param): owners[name] for row in rows for name, param in row} if owners is not None else {}
        for bucket in row_buckets:
            scatter = owner_scatter(bucket.params[0], self.state)
            assert scatter is not None, "owner rows are formed of reduce-scattered parameters (row_class)"
            bucket.shard_by_owner([owner_of[id(param)] for param in bucket.params], *scatter)
        buckets += row_buckets
        buckets.sort(key=lambda bucket: max(position[id(param)] for param in bucket.params))
        for index, bucket in enumerate(buckets):
            bucket.index = index
        return buckets

    def _pack(self, units: list[list[nn.Parameter]], bucket_bytes: int | None = -1) -> list[GradBucket]:
        """Pack units (one parameter, or one owner row) in the order given, one open bucket per
        (reduction, dtype); a bucket closes when the next unit would take it past `bucket_bytes`
        (default `self.bucket_bytes`; None: no limit; a unit larger than that gets a bucket of
        its own)."""
        limit = self.bucket_bytes if bucket_bytes == -1 else bucket_bytes
        buckets: list[GradBucket] = []
        open_buckets: dict[tuple, GradBucket] = {}
        for unit in units:
            reduction = gradient_reduction(unit[0], self.state)
            dtype = self.reduce_dtype or torch.promote_types(unit[0].dtype, torch.float32)
            key = (reduction.key, dtype)
            numel = sum(param.numel() for param in unit)
            bucket = open_buckets.get(key)
            element = torch.empty((), dtype=dtype).element_size()
            if bucket is not None and limit is not None and (bucket.numel + numel) * element > limit:
                bucket = None
            if bucket is None:
                bucket = GradBucket(len(buckets), reduction, dtype, [], [])
                buckets.append(bucket)
                open_buckets[key] = bucket
            for param in unit:
                bucket.params.append(param)
                bucket.offsets.append(bucket.numel)
                bucket.numel += param.numel()
        return buckets

    def _shard_by_owner(self, buckets: list[GradBucket], names: Mapping[int, str], owners: Mapping[str, int]) -> None:
        """Reduce-scatter the buckets whose group is their parameters' replica group (the group
        the owners are ranks of) when its padded input is under twice the all-reduced buffer:
        a ring reduce-scatter sends (p-1)/p of its input, an all-reduce 2(p-1)/p of its own."""
        for bucket in buckets:
            scatter = owner_scatter(bucket.params[0], self.state)
            if scatter is None or any(names[id(p)] not in owners for p in bucket.params):
                continue
            plain = bucket.numel + len(bucket.params)
            offsets = list(bucket.offsets)
            bucket.shard_by_owner([owners[names[id(p)]] for p in bucket.params], *scatter)
            if bucket.length >= 2 * plain:  # padding would cost more than the reduce-scatter saves
                bucket.owners, bucket.segment, bucket.offsets = None, 0, offsets
                bucket.scatter_group = bucket.then_over = None

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
                buffer[offset : offset + param.numel()].copy_(param.grad.reshape(-1))
        flags = torch.tensor([float(param.grad is not None) for param in bucket.params], dtype=bucket.dtype)
        positions = torch.tensor(bucket.flag_positions, dtype=torch.long)
        buffer[positions.to(buffer.device)] = flags.to(buffer.device)
        if bucket.reduction.scale != 1.0:
            buffer.mul_(bucket.reduction.scale)  # before the sum, as Megatron: no fp16/bf16 overflow
        bucket.buffer = buffer
        group = bucket.reduction.group
        if bucket.sharded:
            bucket.result = buffer.new_empty(bucket.segment)
            bucket.work = bucket.owner_group.reduce_scatter_async(buffer, bucket.result)
        else:
            bucket.result = buffer
            bucket.work = group.all_reduce_async(buffer)
        bucket.launched = True

    def finish(self) -> None:
        """Reduce what backward has not launched yet, wait for everything and write the reduced
        gradients into `p.grad` (in the parameter's dtype); then ready for the next step."""
        for bucket in self.buckets[self._next_launch :]:
            self._launch(bucket)
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
            if bucket.then_over is not None:  # TP-partial: the owner segment's sum over TP, in place
                bucket.then_over.all_reduce(bucket.launched_result)
        if not self.buckets:
            return
        received = [bucket.received((bucket.scatter_group or bucket.reduction.group).rank) for bucket in self.buckets]
        # One host read of every flag (one device synchronisation per step, not per bucket).
        flag_tensors = [
            bucket.launched_result[[flag for _, _, flag in mine]]
            for bucket, mine in zip(self.buckets, received)
            if mine
        ]
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
                reduced = bucket.launched_result[offset : offset + param.numel()].view(param.shape)
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
            for name, (nbytes, _) in bucket.sent().items():
                out[name] += nbytes
        return dict(out)

    def describe(self) -> str:
        per_group: dict[str, list[GradBucket]] = defaultdict(list)
        for bucket in self.buckets:
            per_group[bucket.reduction.group.name].append(bucket)
        parts = [
            f"{name}: {len(bs)} buckets ({sum(b.sharded for b in bs)} reduce-scattered to their owners), "
            f"{sum(b.numel for b in bs) / 1e6:.3g}M elements, {sum(b.nbytes for b in bs) / 2**20:.3g} MiB"
            for name, bs in per_group.items()
        ]
        return "gradient reduction: " + ("; ".join(parts) if parts else "none (no replicas)")
