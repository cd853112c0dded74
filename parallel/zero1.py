"""ZeRO-1 for the job's optimizer (distributed Per-Head Muon): each parameter has one owner in
its replica group, which alone holds its optimizer state and steps it; the updated parameters
are then exchanged. The job builds the optimizer and hands it in with each parameter's cost.

Ownership plan, exchange layout and traffic: docs/data_parallel.md ("ZeRO-1").
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from k3train.parallel.comm import Group
from k3train.parallel.grad_reduce import DEFAULT_BUCKET_BYTES, replica_group, row_class
from k3train.parallel.mixed_precision import MainGradReducer, MasterWeights, cast_trainable_parameters
from k3train.parallel.state import ParallelState
from k3train.parallel.tensor import _MeshCache, as_global_dtensor, is_sharded, local_from_saved

ParameterCosts = Mapping[str, tuple[bool, int]]
"""Parameter name -> (routed to Muon, optimizer cost): `k3train.optim.builder.parameter_costs`."""


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


def plan_ownership(model: nn.Module, costs: ParameterCosts, state: ParallelState) -> OwnershipPlan:
    """Deterministic owner assignment per replica group: owner rows first, then greedy longest
    processing time first. (Name and signature are a contract: the job, the reducer's buckets
    and the optimizer's work split all read this plan.)

    Rows: the parameters that can be reduce-scattered to their owners (`grad_reduce.row_class`:
    reduced over their replica group), grouped by that class (reduction, dtype, element count) in
    reverse registration order (about backward's), are cut into runs of `p` (the group size);
    each run becomes one row, one parameter per rank: the run's costliest parameter to the rank
    with the least cost so far, and so on. A bucket of whole rows reduce-scatters without padding
    (`grad_reduce.owner_rows`), and every rank gains the same elements per row, so the exchange
    buffers stay even too. The rest (the last `n mod p` of each class, and the parameters reduced
    over `data_tensor`): first the Muon parameters, largest Newton–Schulz cost first, each to the
    rank with the least cost so far (that balances the step's compute); then the AdamW
    parameters, largest first, each to the rank with the fewest elements so far (their cost,
    numel, is negligible next to Newton–Schulz, so they are better spent evening out the
    exchange buffers and the state memory). Depends only on names, shapes, markers, costs and
    group sizes, so every rank of a group computes the same plan without communication. `costs`
    names the parameters to place (the optimizer's); the Muon/AdamW split and the costs come
    from the optimizer's side (`k3train.optim.builder.parameter_costs`).
    """
    params = dict(model.named_parameters())
    backward_order = [name for name, _ in reversed(list(model.named_parameters())) if name in costs]
    by_group: dict[str, list[str]] = defaultdict(list)
    group_size: dict[str, int] = {}
    for name in backward_order:
        group = replica_group(params[name], state)
        by_group[group.name].append(name)
        group_size[group.name] = group.size
    owners: dict[str, int] = {}
    group_of: dict[str, str] = {}
    totals: dict[str, list[int]] = {}
    numels: dict[str, list[int]] = {}
    for group_name, names in by_group.items():
        size = group_size[group_name]
        load = [0] * size
        count = [0] * size

        def place(name: str, rank: int) -> None:
            # B023 is wrong here: place() runs within the iteration whose pools it fills
            owners[name], group_of[name] = rank, group_name  # noqa: B023
            load[rank] += costs[name][1]  # noqa: B023
            count[rank] += params[name].numel()  # noqa: B023

        classes: dict[tuple, list[str]] = defaultdict(list)
        for name in names:
            key = row_class(params[name], state)
            if key is not None and size > 1:
                classes[key].append(name)
        runs = [
            members[i : i + size]
            for members in classes.values()
            for i in range(0, len(members) - len(members) % size, size)
        ]
        runs.sort(key=lambda run: (-max(costs[n][1] for n in run), run[0]))
        for run in runs:
            by_cost = sorted(run, key=lambda n: (-costs[n][1], n))
            by_load = sorted(range(size), key=lambda r: (load[r], count[r], r))
            for name, rank in zip(by_cost, by_load):
                place(name, rank)
        # The rest (the reducer pools the reduce-scatterable part into one bucket per reduction,
        # padded to its fullest owner): Muon by cost (the step's compute), then AdamW by elements,
        # counted per pool, so that they even out each pool's segments.
        pool_count: dict[tuple | None, list[int]] = defaultdict(lambda: [0] * size)  # noqa: B023 (used within this iteration)

        def pool_of(name: str) -> tuple | None:
            key = row_class(params[name], state)
            return None if key is None else key[0]

        rest = [n for n in names if n not in owners]
        muon = sorted((n for n in rest if costs[n][0]), key=lambda n: (-costs[n][1], n))
        adamw = sorted((n for n in rest if not costs[n][0]), key=lambda n: (-costs[n][1], n))
        for name in muon:
            rank = min(range(size), key=lambda r: (load[r], pool_count[pool_of(name)][r], r))
            place(name, rank)
            pool_count[pool_of(name)][rank] += params[name].numel()
        for name in adamw:
            rank = min(range(size), key=lambda r: (pool_count[pool_of(name)][r], count[r], load[r], r))
            place(name, rank)
            pool_count[pool_of(name)][rank] += params[name].numel()
        totals[group_name], numels[group_name] = load, count
    return OwnershipPlan(owners, group_of, totals, numels)


# ---------------------------------------------------------------------------------------------
# ZeRO-1 parameter exchange


@dataclass(frozen=True)
class FlatExchange:
    """One replica group's parameters of one dtype, rank r's owned ones back to back in a flat
    buffer that is all-gathered (padded to the longest rank's). ZeRO-1 exchanges parameters
    this way, and the Newton–Schulz split over DP ranks (`muon_split.py`) exchanges updates."""

    group: Group
    dtype: torch.dtype
    device: torch.device
    per_rank: list[list[tuple[nn.Parameter, int]]]
    """For each rank of the group: (parameter, offset in its flat buffer), in model order."""

    @property
    def length(self) -> int:
        """Longest per-rank buffer (every rank's buffer is padded to it)."""
        return max((offset + p.numel() for owned in self.per_rank for p, offset in owned[-1:]), default=0)

    def pieces(self, rank: int, start: int, stop: int) -> Iterator[tuple[nn.Parameter, int, int, int]]:
        """(parameter, its first element, element count, position in the chunk) for the parts of
        rank `rank`'s buffer inside [start, stop)."""
        for param, offset in self.per_rank[rank]:
            lo, hi = max(start, offset), min(stop, offset + param.numel())
            if lo < hi:
                yield param, lo - offset, hi - lo, lo - start

    def all_gather(
        self,
        chunk_bytes: int,
        source: Callable[[nn.Parameter], torch.Tensor | None],
        sink: Callable[[nn.Parameter], torch.Tensor | None],
    ) -> None:
        """All-gather the padded flat buffers in chunks of about `chunk_bytes`: this rank's
        pieces are read from `source(param)` (a flat tensor; None sends zeros), every other
        rank's are written into `sink(param)` (a flat tensor; None drops them)."""
        group, me = self.group, self.group.rank
        chunk = max(1, chunk_bytes // torch.empty((), dtype=self.dtype).element_size())
        length = self.length
        for start in range(0, length, chunk):
            count = min(chunk, length - start)
            local = torch.zeros(count, dtype=self.dtype, device=self.device)
            for param, first, n, at in self.pieces(me, start, start + count):
                flat = source(param)
                if flat is not None:
                    local[at : at + n].copy_(flat[first : first + n])
            gathered = group.all_gather(local)
            for rank in range(group.size):
                if rank == me:
                    continue
                base = rank * count
                for param, first, n, at in self.pieces(rank, start, start + count):
                    flat = sink(param)
                    if flat is not None:
                        flat[first : first + n].copy_(gathered[base + at : base + at + n])


@dataclass(frozen=True)
class _Exchange(FlatExchange):
    """ZeRO-1's exchange of updated parameters: the flat all-gather, and the broadcasts."""

    in_order: list[tuple[nn.Parameter, int]] = dataclasses.field(default_factory=list)
    """(parameter, owner) in model order: the broadcast order, the same on every rank."""
    broadcast: list[tuple[nn.Parameter, int]] = dataclasses.field(default_factory=list)
    """(parameter, owner), model order: the parameters the all-gather leaves out (`per_rank` does
    not hold them) and their owners broadcast instead (`_broadcast_instead`)."""

    def sent(self, chunk_elements: int) -> tuple[int, int]:
        """(bytes, messages) this rank's counter records per step in the all-gather mode: the
        padded buffer in chunks, and the broadcasts of the parameters it owns."""
        element = torch.empty((), dtype=self.dtype).element_size()
        mine = [p for p, owner in self.broadcast if owner == self.group.rank]
        return (
            self.length * element + sum(p.numel() for p in mine) * element,
            math.ceil(self.length / chunk_elements) + len(mine),
        )

    def wire_bytes(self) -> float:
        """Bytes this rank puts on the wire per step on a ring: (p−1) × the padded buffer for
        the all-gather; about one copy of each broadcast parameter (a pipelined ring broadcast
        has every rank but the last forward it once)."""
        element = torch.empty((), dtype=self.dtype).element_size()
        size = self.group.size
        return ((size - 1) * self.length + (size - 1) / size * sum(p.numel() for p, _ in self.broadcast)) * element


class DistributedOptimizer:
    """The training loop's optimizer under data parallelism, with or without ZeRO-1.

    `zero1=False`: every rank steps every parameter (a replicated optimizer). `zero1=True`: each
    rank steps only the parameters it owns (`plan`), holding their state only, then the updated
    parameters are exchanged (`exchange`: "all_gather" of flat per-rank buffers, or "broadcast"
    per parameter). Both give the same parameters bit for bit: the owner runs exactly the
    computation every rank would run.

    `optimizer`: the job's optimizer over every trainable parameter of `model`, built with named
    param groups (`k3train.optim.builder.build_optimizer`) and not stepped yet; under ZeRO-1 its
    groups are cut down to the owned parameters (the builder stays the one place that knows the
    hyper-parameters). `costs`: each of those parameters' (is Muon, cost), which the ownership
    plan balances (`k3train.optim.builder.parameter_costs`).

    `param_groups` are the optimizer's groups (the same groups on every rank, possibly empty
    under ZeRO-1), so `set_lr` works. For checkpoints, register this object itself with the
    Checkpointer: `state_dict()` holds `state.<parameter name>.*` for the owned parameters only
    (DP ranks' keys are disjoint, DCP unions them), with the state of TP-sharded parameters as
    DTensors of the full tensor; on load each rank takes the entries of the parameters it owns
    now, sliced to its TP shard, so a checkpoint reloads under another DP or TP size (or without
    ZeRO, or in one process).

    `model_dtype` (e.g. bf16): mixed precision with sharded masters. The owned parameters get fp32
    masters (`MasterWeights`, from the model's fp32 values) that the optimizer steps instead;
    then the model's trainable parameters are cast to `model_dtype` and the exchange moves them
    in it. The gradients come from a `MainGradReducer` (`take_gradients_from`); the masters are
    saved in the state dict as each owned parameter's `master_weight` entry.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: nn.Module,
        state: ParallelState,
        costs: ParameterCosts,
        zero1: bool = True,
        exchange: Literal["all_gather", "broadcast"] = "all_gather",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        model_dtype: torch.dtype | None = None,
    ) -> None:
        if exchange not in ("all_gather", "broadcast"):
            raise ValueError(f"exchange must be 'all_gather' or 'broadcast', got {exchange!r}")
        self.state = state
        self.zero1 = zero1
        self.exchange = exchange
        self.bucket_bytes = bucket_bytes
        self.params = [p for p in model.parameters() if p.requires_grad]
        named = dict(model.named_parameters())
        _check_optimizer(optimizer, named, costs)
        self.plan = plan_ownership(model, costs, state)
        self.optimizer = optimizer
        self._params_by_name = named
        self._meshes = _MeshCache()
        self._owned_names = [
            name
            for name in self.plan.owners
            if not zero1 or self.plan.owners[name] == replica_group(named[name], state).rank
        ]
        if zero1:
            owned = set(self._owned_names)
            for group in self.optimizer.param_groups:
                keep = [i for i, name in enumerate(group["param_names"]) if name in owned]
                group["params"] = [group["params"][i] for i in keep]
                group["param_names"] = [group["param_names"][i] for i in keep]
        self.master_weights: MasterWeights | None = None
        self._reducer: MainGradReducer | None = None
        if model_dtype is not None:
            owned_names = set(self._owned_names)
            self.master_weights = MasterWeights(
                ((n, p) for n, p in model.named_parameters() if n in owned_names), state, zero1
            )
            for group in self.optimizer.param_groups:
                group["params"] = [self.master_weights.by_name[n] for n in group["param_names"]]
            cast_trainable_parameters(model, model_dtype)
        self._exchanges = self._build_exchanges(model) if zero1 else []

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def owned_parameter_names(self) -> list[str]:
        return list(self._owned_names)

    def take_gradients_from(self, reducer: MainGradReducer) -> None:
        """Mixed precision: the reducer whose buffers hold the gradients the masters step on."""
        self._reducer = reducer

    def gradients_for_step(self) -> list[torch.Tensor]:
        """The tensors whose `.grad` the step uses, for clipping: the model's parameters, or
        under mixed precision the owned masters with their gradients taken from the reducer now
        (after the reduction and the expert step's replica gradients)."""
        if self.master_weights is None:
            return list(self.params)
        assert self._reducer is not None, "mixed precision needs take_gradients_from(reducer) before the step"
        return list(self.master_weights.take_gradients(self._reducer))

    def owner_only_gradients(self) -> bool | None:
        """Whether the norm needs the share of owner-only gradients (the same on every rank of a
        stage); None: let the clip read it off the gradients' marks (fp32 weights)."""
        if self.master_weights is None:
            return None
        return self.zero1 and any(replica_group(p, self.state).size > 1 for p in self.params)

    def gradient_owners(self) -> dict[str, int] | None:
        """Under ZeRO-1, each parameter's owner (index in its replica group), for the
        `GradientReducer` to reduce-scatter gradients to their owners; None without ZeRO-1
        (every rank steps every parameter, so every rank needs every gradient)."""
        return dict(self.plan.owners) if self.zero1 else None

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
            exchanges[key].in_order.append((param, self.plan.owners[name]))
        for exchange in exchanges.values():
            left_out = (
                _broadcast_instead(exchange.in_order, exchange.group.size) if self.exchange == "all_gather" else set()
            )
            for param, owner in exchange.in_order:
                if id(param) in left_out:
                    exchange.broadcast.append((param, owner))
                    continue
                owned = exchange.per_rank[owner]
                owned.append((param, owned[-1][1] + owned[-1][0].numel() if owned else 0))
        return list(exchanges.values())

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self) -> None:
        """Step the owned parameters (all of them without ZeRO-1), then share the results."""
        self.optimizer.step()
        if self.master_weights is not None:
            self.master_weights.copy_to_model()
        for exchange in self._exchanges:
            if self.exchange == "all_gather":
                self._all_gather(exchange)
                for param, owner in exchange.broadcast:  # model order, the same on every rank
                    exchange.group.broadcast(param.data, owner)
            else:
                self._broadcast(exchange)

    def _all_gather(self, exchange: _Exchange) -> None:
        """Padded flat buffers of the owned parameters, all-gathered in place."""
        exchange.all_gather(self.bucket_bytes, lambda param: param.data.view(-1), lambda param: param.data.view(-1))

    def _broadcast(self, exchange: _Exchange) -> None:
        """One broadcast per parameter from its owner, in model order (the same on every rank)."""
        for param, owner in exchange.in_order:
            exchange.group.broadcast(param.data, owner)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Every parameter's gradient (owned or not: all of them were reduced), and under mixed
        precision the masters' gradients and the reducer's buffers."""
        if self.master_weights is not None:
            self.master_weights.zero_grad()
            if self._reducer is not None:
                self._reducer.zero_main_grads()
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
        return {
            key: local_from_saved(value, param).clone()
            if isinstance(value, torch.Tensor) and value.ndim == param.ndim
            else value
            for key, value in param_state.items()
        }

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
        if self.master_weights is not None:
            for name, master in self.master_weights.by_name.items():
                entry = dict(state.get(name, {}))
                entry.update(self._global_view(name, {"master_weight": master.detach()}))
                state[name] = entry
        return {"state": state, "param_groups": groups}

    def _global_view(self, name: str, param_state: dict[str, Any]) -> dict[str, Any]:
        """Sharded parameters' state tensors (TP shards, expert stacks) as DTensors of the full
        tensor, so a checkpoint holds each momentum once, reloadable under another layout."""
        param = self._params_by_name[name]
        if not is_sharded(param):
            return param_state
        return {
            key: as_global_dtensor(value, param, self._meshes)
            if isinstance(value, torch.Tensor) and value.shape == param.shape
            else value
            for key, value in param_state.items()
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take the entries of the parameters this rank owns now from a by-name state dict (one
        rank's, or the union of every rank's); owned parameters absent from it start fresh."""
        names = self._positional_names()
        saved = state_dict["state"]
        local = {name: dict(self._local_view(name, saved[name])) for name in names if name in saved}
        if self.master_weights is not None:
            without = [name for name in names if "master_weight" not in local.get(name, {})]
            with torch.no_grad():
                for name, entry in local.items():
                    if "master_weight" in entry:
                        self.master_weights.by_name[name].data.copy_(entry["master_weight"])
            self.master_weights.copy_from_model(without)  # a checkpoint of fp32 weights: its rounding
            self.master_weights.copy_to_model()
        for entry in local.values():
            entry.pop("master_weight", None)
        state = {i: local[name] for i, name in enumerate(names) if local.get(name)}
        if len(state_dict["param_groups"]) != len(self.optimizer.param_groups):
            raise ValueError(
                f"state dict has {len(state_dict['param_groups'])} param groups, "
                f"the optimizer {len(self.optimizer.param_groups)}"
            )
        groups, position = [], 0
        for options, group in zip(state_dict["param_groups"], self.optimizer.param_groups):
            count = len(group["params"])
            groups.append(
                {
                    **options,
                    "params": list(range(position, position + count)),
                    "param_names": list(group["param_names"]),
                }
            )
            position += count
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})


def _broadcast_instead(in_order: list[tuple[nn.Parameter, int]], size: int) -> set[int]:
    """Ids of the parameters to broadcast from their owners rather than all-gather. The
    all-gather pads every rank's buffer to the longest, so one parameter much larger than a
    rank's fair share (an embedding or head owned whole) makes every rank send `(p−1)` times
    its size; a pipelined broadcast of it costs each rank about one copy. Greedy: while the
    largest all-gathered parameter of the longest buffer saves more all-gather bytes per rank,
    `(p−1) ×` the drop of the longest buffer, than its broadcast costs (its size), broadcast it."""
    owned: list[list[nn.Parameter]] = [[] for _ in range(size)]
    for param, owner in in_order:
        owned[owner].append(param)
    lengths = [sum(p.numel() for p in params) for params in owned]
    left_out: set[int] = set()
    while True:
        longest = max(range(size), key=lambda r: (lengths[r], -r))
        candidates = [p for p in owned[longest] if id(p) not in left_out]
        if not candidates:
            return left_out
        biggest = max(candidates, key=lambda p: p.numel())
        after = max(lengths[r] - (biggest.numel() if r == longest else 0) for r in range(size))
        if (size - 1) * (lengths[longest] - after) <= biggest.numel():
            return left_out
        left_out.add(id(biggest))
        lengths[longest] -= biggest.numel()


def _check_optimizer(optimizer: torch.optim.Optimizer, params: dict[str, nn.Parameter], costs: ParameterCosts) -> None:
    """The handed-in optimizer must be fresh, name its parameters, and hold exactly the model's
    parameters that `costs` places (else ownership and stepping would disagree)."""
    if optimizer.state:
        raise ValueError("DistributedOptimizer needs an optimizer that has not stepped yet (no state)")
    names: list[str] = []
    for group in optimizer.param_groups:
        if "param_names" not in group:
            raise ValueError("DistributedOptimizer needs named param groups (build_optimizer's)")
        for name, param in zip(group["param_names"], group["params"]):
            if params.get(name) is not param:
                raise ValueError(f"optimizer parameter {name!r} is not the model's parameter of that name")
        names.extend(group["param_names"])
    missing = set(costs) - set(params)
    if missing:
        raise ValueError(f"costs name parameters the model does not have: {sorted(missing)[:5]}")
    if sorted(names) != sorted(costs):
        raise ValueError(
            f"the optimizer's parameters and the costs' parameters differ: {sorted(set(names) ^ set(costs))[:5]}"
        )
