"""Data parallelism: bucketed gradient reduction, the ZeRO-1 optimizer (distributed Per-Head
Muon) and the global gradient norm.

How a training step uses it (the order matters)::

    reducer = GradientReducer(model, state)                         # once: buckets + hooks
    optimizer = DistributedOptimizer(model, config.optimizer, state, zero1=True)
    ...
    set_lr(optimizer, lr)                                           # writes optimizer.param_groups
    for i, micro_batch in enumerate(micro_batches):
        with reducer.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext():
            (loss(micro_batch) / len(micro_batches)).backward()    # last one: hooks launch all-reduces
    reducer.finish()                                                # wait; averaged grads in p.grad
    step_loss = average_over_dp(loss_sum / len(micro_batches), state)   # same value on every rank
    grad_norm = clip_grad_norm(model.parameters(), max_norm, state)     # global, same on every rank
    if finite(step_loss, grad_norm):
        optimizer.step()                                            # owners step, then param exchange
    optimizer.zero_grad()

**Gradient reduction** (`GradientReducer`). Parameters are packed, in reverse registration order
(about the order backward produces their gradients), into buckets of about `bucket_bytes`; a
bucket holds parameters that reduce over the same group with the same scale:

    plain parameter                     SUM over state.dp,          scale 1/dp  (= average)
    param.expert_parallel = True        SUM over state.expert_dp,   scale 1/dp
    param.tp_partial_grad = True        SUM over state.data_tensor, scale 1/dp
    param.sequence_parallel = True      the same, when state.sequence_parallel (else plain)

Why these: an expert's local gradient already sums its EP group's tokens (the all-to-all
backward brings them home), so summing over the expert-data group covers every token of the
step once and dividing by dp turns the per-replica mean losses into the global mean (Megatron's
`expert_gradient_scaling_factor`). A TP-replicated parameter whose gradient each TP rank sees
only in part (`tp_partial_grad`, parallel/tensor.py: its own heads, or its 1/tp of the sequence
under sequence parallelism) needs the SUM over TP, then the average over DP; both at once is
one SUM over the dp×tp ranks of the stage (`data_tensor`) / dp. So with this reducer,
`reduce_tensor_parallel_grads` must NOT be called as well (it would sum over TP twice).

A post-accumulate-grad hook marks a parameter ready; when a bucket's last parameter is ready the
bucket is copied (scaled) into one flat buffer (fp32, or the parameters' dtype if wider) and its
all-reduce launched asynchronously, so communication overlaps the rest of backward. The buffer
ends with one element per parameter, 1 if this rank has a gradient for it: a parameter that no
rank has a gradient for (layer 0's first AttnRes mixes a single source and never uses its query)
keeps `grad = None` as in one process, so the optimizer skips it there too; one with a gradient
on some ranks only gets the average with zeros from the others. Buckets launch strictly in
bucket order (a ready bucket waits for earlier ones), so every rank issues the same
collectives in the same order whatever order its hooks fire in — a mismatch would pair
different buckets in one collective. `finish()` launches what is left (buckets whose
parameters got no hook), waits and writes the averaged gradients back into `p.grad` in the
parameter's dtype. Under gradient accumulation the hooks are off inside `no_sync()` (or
`set_last_micro_batch(False)`): gradients accumulate locally and only the last micro-batch's
backward reduces. Async collectives are counted in `state.counter` like the
synchronous wrappers of comm.py (bytes this rank contributes, one message each).

**ZeRO-1 / distributed Per-Head Muon** (`DistributedOptimizer`). Whole-parameter ownership:
every parameter has one owner in the group it is replicated over (`dp`, or `expert_dp` for
expert parameters), chosen by `plan_ownership`: Muon parameters largest Newton–Schulz cost first
(`BlockLayout.cost` = `MuonWorkItem.cost`), each to the rank with the least cost so far; then
AdamW parameters (cost: numel) largest first, each to the rank with the fewest elements so far;
ties by name and lowest rank, so every rank computes the same plan from names and shapes
alone. Each rank's optimizer (built by `build_optimizer`, then cut down to its own parameters)
holds state only for what it owns and steps only that: a Muon matrix and its head blocks are
orthogonalised whole on its owner, exactly as in one process. The updated parameters then
travel to the other replicas.

Parameter exchange: all-gather of flat per-rank buffers (default) rather than one broadcast per
parameter. Per replica group and dtype, rank r's owned parameters are laid out back to back in
a flat buffer; the buffers are padded to the longest and all-gathered in chunks of
`bucket_bytes`. Messages: ceil(longest / chunk) per step instead of one per parameter (the
debug model has 226 parameter tensors; K3 has thousands per stage, where per-message latency
dominates); bytes each rank sends: the longest buffer, so the padding overhead is
`size·longest / total − 1` (reported by `OwnershipPlan.describe`; 1.8% for the debug model
over DP4, which is why the AdamW parameters are placed by elements). `exchange="broadcast"` is
kept for comparison: no padding (the owner sends exactly its parameters), one message per
parameter. Total traffic per step: the all-reduce of gradients (as without ZeRO) plus one
all-gather of the parameters; Muon adds nothing else, because every rank already holds the
whole reduced gradient of each matrix it owns (Moonlight's extra "DP gather" of momentum is not
needed when ownership is whole-matrix).

**Global gradient norm** (`clip_grad_norm`). After `finish()` the gradients are identical across
DP, so no DP sum. Dense parameters: TP-sharded ones (`param.tensor_parallel = True`) count on
every TP rank, replicated ones only on tp_rank 0, summed over TP; expert parameters are whole
experts, distinct across the EP group: summed over EP. Then the stage sums are summed over PP.
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Literal, Optional

import torch
import torch.distributed as dist
from torch import nn

from k3train.optim.builder import build_optimizer, route_parameters
from k3train.optim.clip import clip_grad_norm_
from k3train.optim.config import OptimizerConfig
from k3train.optim.muon import block_layout
from k3train.parallel.comm import Group
from k3train.parallel.state import ParallelState
from k3train.parallel.tensor import _MeshCache, as_global_dtensor, is_sharded, local_from_saved

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
    """The reduction `param`'s gradient needs (see the module docstring for why)."""
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


def average_over_dp(value: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """The mean of a per-replica scalar (e.g. the step loss) over DP; a new fp64 tensor, the
    same on every rank (so a NaN guard decides the same everywhere)."""
    total = value.detach().to(torch.float64).clone()
    return state.dp.all_reduce(total) / state.layout.dp


# ---------------------------------------------------------------------------------------------
# Gradient reduction


@dataclass(eq=False)
class GradBucket:
    """Parameters reduced together: one flat buffer, one all-reduce."""

    index: int
    reduction: Reduction
    dtype: torch.dtype
    """Dtype of the flat buffer (and of the all-reduce)."""
    params: list[nn.Parameter]
    offsets: list[int]
    numel: int = 0
    """Gradient elements; the buffer has `numel + len(params)` (the has-gradient flags)."""
    # Per-step state, reset by `GradientReducer.finish`.
    pending: set[int] = field(default_factory=set)
    buffer: Optional[torch.Tensor] = None
    work: Optional[dist.Work] = None
    launched: bool = False

    def reset(self) -> None:
        self.pending = {id(p) for p in self.params}
        self.buffer, self.work, self.launched = None, None, False

    @property
    def nbytes(self) -> int:
        """Bytes of one all-reduce (gradients and flags)."""
        return (self.numel + len(self.params)) * torch.empty((), dtype=self.dtype).element_size()


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
    ) -> None:
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.state = state
        self.bucket_bytes = bucket_bytes
        self.reduce_dtype = reduce_dtype
        self.buckets = self._build_buckets(model)
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
        buffer = torch.zeros(bucket.numel + len(bucket.params), dtype=bucket.dtype, device=bucket.params[0].device)
        for param, offset in zip(bucket.params, bucket.offsets):
            if param.grad is not None:  # an unused parameter contributes zeros (and flag 0)
                buffer[offset:offset + param.numel()].copy_(param.grad.reshape(-1))
        flags = [float(param.grad is not None) for param in bucket.params]
        buffer[bucket.numel:].copy_(torch.tensor(flags, dtype=bucket.dtype))
        if bucket.reduction.scale != 1.0:
            buffer.mul_(bucket.reduction.scale)  # before the sum, as Megatron: no fp16/bf16 overflow
        bucket.buffer = buffer
        bucket.work = _all_reduce_async(bucket.reduction.group, buffer)
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
        # One host read of every flag (one device synchronisation per step, not per bucket).
        flags = torch.cat([b.buffer[b.numel:] for b in self.buckets]).tolist()
        position = 0
        for bucket in self.buckets:
            for param, offset in zip(bucket.params, bucket.offsets):
                has_grad = flags[position] != 0.0
                position += 1
                if not has_grad:
                    continue  # no rank has a gradient for it: stays None, as in one process
                reduced = bucket.buffer[offset:offset + param.numel()].view(param.shape)
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
        parts = [f"{name}: {len(bs)} buckets, {sum(b.numel for b in bs) / 1e6:.3g}M elements, "
                 f"{sum(b.nbytes for b in bs) / 2**20:.3g} MiB" for name, bs in per_group.items()]
        return "gradient reduction: " + ("; ".join(parts) if parts else "none (no replicas)")


# ---------------------------------------------------------------------------------------------
# ZeRO-1 ownership plan


@dataclass(frozen=True)
class OwnershipPlan:
    """Which rank (index in the parameter's replica group) owns each parameter, and the cost
    totals per rank of each replica group."""

    owners: dict[str, int]
    group_of: dict[str, str]
    """Parameter name -> replica group name ("dp" or "expert_dp")."""
    costs: dict[str, list[int]]
    """Replica group name -> cost total per rank."""
    numels: dict[str, list[int]]
    """Replica group name -> owned elements per rank (the parameter-exchange buffer lengths)."""

    def owned(self, group_name: str, rank: int) -> set[str]:
        return {n for n, r in self.owners.items() if r == rank and self.group_of[n] == group_name}

    def imbalance(self, group_name: str) -> float:
        """max / min cost over the group's ranks (inf if a rank owns nothing)."""
        costs = self.costs[group_name]
        return max(costs) / min(costs) if min(costs) > 0 else math.inf

    def describe(self) -> str:
        lines = []
        for name in sorted(self.costs):
            costs, numels = self.costs[name], self.numels[name]
            padding = len(numels) * max(numels) / max(sum(numels), 1) - 1
            lines.append(
                f"ZeRO-1 over {name} ({len(costs)} ranks): cost per rank {costs} "
                f"(max/min {self.imbalance(name):.3f}), elements per rank {numels} "
                f"(all-gather padding {100 * padding:.1f}%)"
            )
        return "\n".join(lines)


def parameter_costs(model: nn.Module, config: OptimizerConfig) -> dict[str, tuple[bool, int]]:
    """(is Muon, optimizer cost) of each trainable parameter: the Newton–Schulz cost of its
    blocks for Muon (what `MuonWorkItem.cost` reports), numel for AdamW."""
    costs = {}
    for route in route_parameters(model, config):
        if route.route == "muon":
            costs[route.name] = (True, block_layout(route.param, config.muon_per_head).cost)
        else:
            costs[route.name] = (False, route.param.numel())
    return costs


def plan_ownership(model: nn.Module, config: OptimizerConfig, state: ParallelState) -> OwnershipPlan:
    """Deterministic greedy (longest processing time first) owner assignment per replica group.

    First the Muon parameters, largest Newton–Schulz cost first, each to the rank with the least
    cost so far: that balances the step's compute. Then the AdamW parameters, largest first,
    each to the rank with the fewest elements so far: their cost (numel) is negligible next to
    Newton–Schulz (a matrix costs about min(rows, cols) times its numel), so they are better
    spent evening out the exchange buffers (less all-gather padding) and the state memory.
    Depends only on names, shapes, markers and group sizes, so every rank of a group computes
    the same plan without communication.
    """
    params = dict(model.named_parameters())
    costs = parameter_costs(model, config)
    by_group: dict[str, list[str]] = defaultdict(list)
    group_size: dict[str, int] = {}
    for name in costs:
        group = replica_group(params[name], state)
        by_group[group.name].append(name)
        group_size[group.name] = group.size
    owners: dict[str, int] = {}
    group_of: dict[str, str] = {}
    totals: dict[str, list[int]] = {}
    numels: dict[str, list[int]] = {}
    for group_name, names in by_group.items():
        load = [0] * group_size[group_name]
        count = [0] * group_size[group_name]
        muon = sorted((n for n in names if costs[n][0]), key=lambda n: (-costs[n][1], n))
        adamw = sorted((n for n in names if not costs[n][0]), key=lambda n: (-costs[n][1], n))
        for name in muon + adamw:
            if costs[name][0]:
                rank = min(range(len(load)), key=lambda r: (load[r], count[r], r))
            else:
                rank = min(range(len(load)), key=lambda r: (count[r], load[r], r))
            owners[name], group_of[name] = rank, group_name
            load[rank] += costs[name][1]
            count[rank] += params[name].numel()
        totals[group_name], numels[group_name] = load, count
    return OwnershipPlan(owners, group_of, totals, numels)


# ---------------------------------------------------------------------------------------------
# ZeRO-1 parameter exchange


@dataclass(frozen=True)
class _Exchange:
    """One replica group's parameters of one dtype: rank r's owned ones back to back."""

    group: Group
    dtype: torch.dtype
    device: torch.device
    per_rank: list[list[tuple[nn.Parameter, int]]]
    """For each rank of the group: (parameter, offset in its flat buffer), in model order."""
    in_order: list[tuple[nn.Parameter, int]]
    """(parameter, owner) in model order: the broadcast order, the same on every rank."""

    @property
    def length(self) -> int:
        """Longest per-rank buffer (every rank's buffer is padded to it)."""
        return max((offset + p.numel() for owned in self.per_rank for p, offset in owned[-1:]), default=0)

    def pieces(self, rank: int, start: int, stop: int) -> Iterator[tuple[torch.Tensor, int, int, int]]:
        """(flat parameter, its first element, element count, position in the chunk) for the
        parts of rank `rank`'s buffer inside [start, stop)."""
        for param, offset in self.per_rank[rank]:
            lo, hi = max(start, offset), min(stop, offset + param.numel())
            if lo < hi:
                yield param.data.view(-1), lo - offset, hi - lo, lo - start


class DistributedOptimizer:
    """The training loop's optimizer under data parallelism, with or without ZeRO-1.

    `zero1=False`: every rank steps every parameter (a replicated optimizer). `zero1=True`: each
    rank steps only the parameters it owns (`plan`), holding their state only, then the updated
    parameters are exchanged (`exchange`: "all_gather" of flat per-rank buffers, or "broadcast"
    per parameter). Both give the same parameters bit for bit: the owner runs exactly the
    computation every rank would run.

    `param_groups` are the optimizer's groups (the same groups on every rank, possibly empty
    under ZeRO-1), so `set_lr` works. For checkpoints, register this object itself with the
    Checkpointer: `state_dict()` holds `state.<parameter name>.*` for the owned parameters only
    (DP ranks' keys are disjoint, DCP unions them), with the state of TP-sharded parameters as
    DTensors of the full tensor; on load each rank takes the entries of the parameters it owns
    now, sliced to its TP shard, so a checkpoint reloads under another DP or TP size (or without
    ZeRO, or in one process).
    """

    def __init__(
        self,
        model: nn.Module,
        config: OptimizerConfig,
        state: ParallelState,
        zero1: bool = True,
        exchange: Literal["all_gather", "broadcast"] = "all_gather",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        if exchange not in ("all_gather", "broadcast"):
            raise ValueError(f"exchange must be 'all_gather' or 'broadcast', got {exchange!r}")
        self.state = state
        self.zero1 = zero1
        self.exchange = exchange
        self.bucket_bytes = bucket_bytes
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.plan = plan_ownership(model, config, state)
        # Built over every parameter (no state is created before the first step), then cut down
        # to the owned ones: the builder stays the one place that knows the hyper-parameters.
        self.optimizer = build_optimizer(model, config)
        named = dict(model.named_parameters())
        self._params_by_name = named
        self._meshes = _MeshCache()
        self._owned_names = [name for name in self.plan.owners
                             if not zero1 or self.plan.owners[name] == replica_group(named[name], state).rank]
        if zero1:
            owned = set(self._owned_names)
            for group in self.optimizer.param_groups:
                keep = [i for i, name in enumerate(group["param_names"]) if name in owned]
                group["params"] = [group["params"][i] for i in keep]
                group["param_names"] = [group["param_names"][i] for i in keep]
        self._exchanges = self._build_exchanges(model) if zero1 else []

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def owned_parameter_names(self) -> list[str]:
        return list(self._owned_names)

    def _build_exchanges(self, model: nn.Module) -> list[_Exchange]:
        exchanges: dict[tuple[str, torch.dtype], _Exchange] = {}
        for name, param in model.named_parameters():
            if name not in self.plan.owners:
                continue
            group = replica_group(param, self.state)
            if group.size == 1:
                continue
            if not param.is_contiguous():
                raise ValueError(f"ZeRO-1 exchange needs contiguous parameters; {name} is not")
            key = (group.name, param.dtype)
            if key not in exchanges:
                exchanges[key] = _Exchange(group, param.dtype, param.device, [[] for _ in range(group.size)], [])
            exchange, owner = exchanges[key], self.plan.owners[name]
            owned = exchange.per_rank[owner]
            owned.append((param, owned[-1][1] + owned[-1][0].numel() if owned else 0))
            exchange.in_order.append((param, owner))
        return list(exchanges.values())

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self) -> None:
        """Step the owned parameters (all of them without ZeRO-1), then share the results."""
        self.optimizer.step()
        for exchange in self._exchanges:
            if self.exchange == "all_gather":
                self._all_gather(exchange)
            else:
                self._broadcast(exchange)

    def _all_gather(self, exchange: _Exchange) -> None:
        """Padded flat buffers, all-gathered in chunks of about `bucket_bytes`."""
        group, me = exchange.group, exchange.group.rank
        chunk = max(1, self.bucket_bytes // torch.empty((), dtype=exchange.dtype).element_size())
        length = exchange.length
        for start in range(0, length, chunk):
            count = min(chunk, length - start)
            local = torch.zeros(count, dtype=exchange.dtype, device=exchange.device)
            for flat, first, n, at in exchange.pieces(me, start, start + count):
                local[at:at + n].copy_(flat[first:first + n])
            gathered = group.all_gather(local)
            for rank in range(group.size):
                if rank == me:
                    continue
                base = rank * count
                for flat, first, n, at in exchange.pieces(rank, start, start + count):
                    flat[first:first + n].copy_(gathered[base + at:base + at + n])

    def _broadcast(self, exchange: _Exchange) -> None:
        """One broadcast per parameter from its owner, in model order (the same on every rank)."""
        for param, owner in exchange.in_order:
            exchange.group.broadcast(param.data, owner)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Every parameter's gradient (owned or not: all of them were reduced)."""
        for param in self.params:
            if param.grad is None:
                continue
            if set_to_none:
                param.grad = None
            else:
                param.grad.zero_()

    # ------------------------------------------------------------------ state by name
    def _local_view(self, name: str, param_state: dict[str, Any]) -> dict[str, Any]:
        """Inverse of `_global_view`: this rank's TP shard of each saved state tensor."""
        param = self._params_by_name[name]
        if not is_sharded(param):
            return param_state
        return {key: local_from_saved(value, param).clone()
                if isinstance(value, torch.Tensor) and value.ndim == param.ndim else value
                for key, value in param_state.items()}

    def _positional_names(self) -> list[str]:
        return [name for group in self.optimizer.param_groups for name in group["param_names"]]

    def state_dict(self) -> dict[str, Any]:
        """`{"state": {name: {...}}, "param_groups": [options...]}`: the owned parameters' state
        by name; the group options (lr, betas, ...) without their parameter lists, identical on
        every rank."""
        inner = self.optimizer.state_dict()
        names = self._positional_names()
        groups = [{k: v for k, v in g.items() if k not in ("params", "param_names")} for g in inner["param_groups"]]
        state = {names[i]: self._global_view(names[i], value) for i, value in inner["state"].items()}
        return {"state": state, "param_groups": groups}

    def _global_view(self, name: str, param_state: dict[str, Any]) -> dict[str, Any]:
        """Sharded parameters' state tensors (TP shards, expert stacks) as DTensors of the full
        tensor, so a checkpoint holds each momentum once, reloadable under another layout."""
        param = self._params_by_name[name]
        if not is_sharded(param):
            return param_state
        return {key: as_global_dtensor(value, param, self._meshes)
                if isinstance(value, torch.Tensor) and value.shape == param.shape else value
                for key, value in param_state.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take the entries of the parameters this rank owns now from a by-name state dict (one
        rank's, or the union of every rank's); owned parameters absent from it start fresh."""
        names = self._positional_names()
        saved = state_dict["state"]
        state = {i: self._local_view(name, saved[name]) for i, name in enumerate(names) if name in saved}
        if len(state_dict["param_groups"]) != len(self.optimizer.param_groups):
            raise ValueError(f"state dict has {len(state_dict['param_groups'])} param groups, "
                             f"the optimizer {len(self.optimizer.param_groups)}")
        groups, position = [], 0
        for options, group in zip(state_dict["param_groups"], self.optimizer.param_groups):
            count = len(group["params"])
            groups.append({**options, "params": list(range(position, position + count)),
                           "param_names": list(group["param_names"])})
            position += count
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})


# ---------------------------------------------------------------------------------------------
# Global gradient norm


def counts_in_norm(param: torch.Tensor, state: ParallelState) -> bool:
    """Whether this rank counts `param`'s gradient in the global norm: TP shards and expert
    weights always (distinct across the ranks they are summed over), TP-replicated parameters
    only on tp_rank 0 (else they would count tp times)."""
    return is_tensor_parallel(param) or is_expert_parallel(param) or state.tp_rank == 0


def _squared_norm(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of squared L2 norms, computed as `clip_grad_norm_` does (fp32 vector norms, stacked),
    so a single process gets the same bits; float64 gradients are normed in float64 first.
    An empty list gives a zero on `device` (NCCL reduces device tensors only)."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = [torch.linalg.vector_norm(g, 2, dtype=torch.promote_types(g.dtype, torch.float32)).float()
             for g in grads]
    return torch.stack(norms).square().sum()


def global_grad_norm_squared(parameters: Iterable[torch.Tensor], state: ParallelState) -> torch.Tensor:
    """Squared global gradient norm of the model (same value on every rank):
    pp.SUM( tp.SUM(dense counted once) + ep.SUM(expert) )."""
    parameters = list(parameters)
    params = [p for p in parameters if p.grad is not None]
    device = parameters[0].device if parameters else torch.device("cpu")
    dense = [p.grad for p in params if not is_expert_parallel(p) and counts_in_norm(p, state)]
    experts = [p.grad for p in params if is_expert_parallel(p)]
    # Every rank of a stage runs both reductions (the EP one is free when ep == 1), so the
    # collectives match whatever parameters a rank holds.
    stage = state.tp.all_reduce(_squared_norm(dense, device)) + state.ep.all_reduce(_squared_norm(experts, device))
    return state.pp.all_reduce(stage)


def clip_grad_norm(parameters: Iterable[torch.Tensor], max_norm: float, state: ParallelState) -> torch.Tensor:
    """Clip every local gradient by the global norm over the whole model; returns that norm
    (before clipping; the same on every rank). `max_norm <= 0` (or inf) only measures.

    Built on `clip_grad_norm_`: it scales all local gradients (replicated ones too) while the
    norm it uses is the global one computed here from the gradients each rank counts.
    """
    params = [p for p in parameters if p.grad is not None]
    total_squared = global_grad_norm_squared(params, state)
    return clip_grad_norm_(params, max_norm, reduce_squared_norm=lambda _local: total_squared)
