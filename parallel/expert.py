"""Expert parallelism: fixed-size all-to-all dispatch in the latent width.

The routed experts of a MoE layer are split over `state.ep` (each rank holds its *home* experts
as stacks); the MoE layer hands the dispatcher latent token slots with expert ids and routing
weights and gets `Σ_k p_k · E_k(latent)` back per token. Buffer shapes depend only on the config
and the micro-batch size (CUDA-graph safe); `balanced` mode places replicas of hot experts on
cold ranks. The experts compute through their own module (`GroupedExperts.grouped_forward`).
Slots, routing, replicas, gradients and statistics: docs/expert_parallel.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional, Protocol

import torch
from torch import nn

from k3train.parallel.comm import Group

Mode = Literal["balanced", "capacity"]
Compute = Literal["grouped", "gather"]
ExpertStacks = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""An experts module's weights `(w1, w3, w2)`: `[G, I, l]`, `[G, I, l]`, `[G, l, I]`."""


class GroupedExperts(Protocol):
    """What the dispatcher needs of a layer's experts module (the model's `LocalExperts`): the
    weight stacks it marks and fetches replicas of, and the module's own computation."""

    w1: nn.Parameter  # [G, I, l]
    w3: nn.Parameter  # [G, I, l]
    w2: nn.Parameter  # [G, l, I]

    def grouped_forward(self, rows: torch.Tensor, ids: torch.Tensor,
                        weights: Optional[ExpertStacks] = None,
                        compute: str = "grouped") -> torch.Tensor:
        """Each row through expert `ids[row]` (other ids: zero rows), with `weights` (stacks
        `(w1, w3, w2)`) instead of the module's own when given."""
        ...


def capacity_per_pair(tokens: int, top_k: int, ep: int, capacity_factor: float) -> int:
    """`C_pair = min(s·k, ceil(capacity_factor · s·k / R))`, at least 1: a function of the config
    and the micro-batch size only."""
    slots = tokens * top_k
    return max(1, min(slots, math.ceil(capacity_factor * slots / ep)))


def routing_statistics_group(state) -> Group:
    """The ranks whose routing statistics one balancer update combines: all that route distinct
    tokens through a layer (data-parallel ranks, and tensor-parallel ranks under sequence
    parallelism). The expert-parallel group is inside it."""
    return state.data_tensor if state.sequence_parallel else state.dp


# ---------------------------------------------------------------------------------------------
# Autograd pieces


class _AllToAll(torch.autograd.Function):
    """Equal-split all-to-all along dim 0; its own adjoint (slice j came from and goes back to j)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return group.all_to_all(x.contiguous())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.group.all_to_all(grad.contiguous()), None


def all_to_all(x: torch.Tensor, group: Group) -> torch.Tensor:
    if group.size == 1:
        return x
    return _AllToAll.apply(x, group)


# ---------------------------------------------------------------------------------------------
# Planner (balanced mode)


@dataclass
class ReplicaPlan:
    """Replica placements for one layer and micro-batch, identical on every rank of the EP group.

    `N = R·M` entries; entry `j` (if `valid[j]`) hosts expert `expert[j]` on rank `dest[j]` in
    replica slot `slot[j]`, holding positions `[start[j], start[j] + amount[j])` of the expert's
    slot interval `[0, load[e])` (the home rank holds `[0, home[e])`). All tensors, fixed shapes.
    """

    expert: torch.Tensor  # [N] int64
    dest: torch.Tensor  # [N] int64
    slot: torch.Tensor  # [N] int64
    start: torch.Tensor  # [N] int64
    amount: torch.Tensor  # [N] int64
    valid: torch.Tensor  # [N] bool
    load: torch.Tensor  # [E] int64, slots routed to each expert over the EP group
    home: torch.Tensor  # [E] int64, slots left on the home rank
    rank_load: torch.Tensor  # [R] int64, planned slots per rank

    @property
    def num_replicas(self) -> torch.Tensor:
        return self.valid.sum()


def _at(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`tensor[index]` for a 0-dim index tensor without reading it on the host."""
    return tensor.index_select(0, index.view(1)).squeeze(0)


def plan_replicas(counts: torch.Tensor, max_replicas_per_rank: int) -> ReplicaPlan:
    """Greedy, deterministic replica planner on the device. `counts [R, E]`: slots each source
    routes to each expert (all-gathered). Runs `R·M` fixed iterations of small tensor ops; an
    iteration that finds nothing to move records an invalid entry."""
    num_ranks, num_experts = counts.shape
    local = num_experts // num_ranks
    entries = num_ranks * max_replicas_per_rank
    device = counts.device
    load = counts.sum(0)
    home = load.clone()
    rank_load = load.view(num_ranks, local).sum(1)
    target = load.sum() // num_ranks  # the even share s·k (every source routes s·k slots)
    used = torch.zeros(num_ranks, dtype=torch.int64, device=device)
    ranks = torch.arange(num_ranks, device=device)
    lowest = torch.iinfo(torch.int64).min
    experts, dests, amounts = [], [], []
    for _ in range(entries):
        surplus = rank_load - target
        source = surplus.argmax()  # first of the most loaded ranks
        home_shares = _at(home.view(num_ranks, local), source)
        expert = source * local + home_shares.argmax()  # its hottest remaining home share
        deficit = target - rank_load
        eligible = (used < max_replicas_per_rank) & (ranks != source)
        dest = torch.where(eligible, deficit, lowest).argmax()
        amount = torch.minimum(torch.minimum(_at(surplus, source), _at(deficit, dest)), _at(home, expert)).clamp(min=0)
        amount = torch.where(_at(eligible, dest), amount, 0)
        home = home.index_add(0, expert.view(1), -amount.view(1))
        rank_load = rank_load.index_add(0, torch.stack([source, dest]), torch.stack([-amount, amount]))
        used = used.index_add(0, dest.view(1), (amount > 0).long().view(1))
        experts.append(expert)
        dests.append(dest)
        amounts.append(amount)
    expert = torch.stack(experts) if experts else torch.zeros(0, dtype=torch.int64, device=device)
    dest = torch.stack(dests) if dests else expert.clone()
    amount = torch.stack(amounts) if amounts else expert.clone()
    valid = amount > 0
    earlier = torch.ones(entries, entries, dtype=torch.bool, device=device).tril(-1)  # [j, j'] j' < j
    slot = (earlier & (dest[:, None] == dest[None, :]) & valid[None, :]).sum(1)
    same_expert_before = earlier & (expert[:, None] == expert[None, :]) & valid[None, :]
    start = home[expert] + (same_expert_before.long() * amount[None, :]).sum(1)
    return ReplicaPlan(expert, dest, slot, start, amount, valid, load, home, rank_load)


# ---------------------------------------------------------------------------------------------
# Slot routing and packing


def home_route(expert_flat: torch.Tensor, local_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`capacity` mode: every slot to its expert's home rank."""
    return torch.div(expert_flat, local_experts, rounding_mode="floor"), expert_flat % local_experts


def balanced_route(expert_flat: torch.Tensor, counts: torch.Tensor, source: int,
                   plan: ReplicaPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """`balanced` mode: (destination, local id) of each slot of `source` under `plan`."""
    num_ranks, num_experts = counts.shape
    local = num_experts // num_ranks
    slots = expert_flat.shape[0]
    device = expert_flat.device
    mine = counts[source]
    # index of each slot among this source's slots of the same expert (slot order)
    order = torch.sort(expert_flat, stable=True).indices
    first = mine.cumsum(0) - mine
    index_in_expert = torch.empty_like(order).scatter_(
        0, order, torch.arange(slots, device=device) - first[expert_flat[order]])
    per_source = mine[expert_flat]
    load = plan.load[expert_flat]
    offset = counts[:source].sum(0)[expert_flat]  # this expert's slots at lower-ranked sources
    position = ((2 * index_in_expert + 1) * load) // (2 * per_source)
    position = (position + offset) % load
    # the replica interval holding `position`, if any: search (expert, start) keys
    span = num_ranks * slots + 1  # > any load
    keys = torch.where(plan.valid, plan.expert * span + plan.start, num_experts * span)
    sorted_keys, key_order = torch.sort(keys, stable=True)
    found = torch.searchsorted(sorted_keys, expert_flat * span + position, right=True) - 1
    entry = key_order[found.clamp(min=0)]
    is_replica = ((found >= 0) & plan.valid[entry] & (plan.expert[entry] == expert_flat)
                  & (position < plan.start[entry] + plan.amount[entry]))
    home_dest, home_id = home_route(expert_flat, local)
    dest = torch.where(is_replica, plan.dest[entry], home_dest)
    local_id = torch.where(is_replica, local + plan.slot[entry], home_id)
    return dest, local_id


def pack_slots(dest: torch.Tensor, weights_flat: torch.Tensor, num_ranks: int,
               capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop policy: per destination keep the `capacity` slots of highest routing weight (ties:
    lower slot index first). Returns (buffer_index [S], keep [S])."""
    slots = dest.shape[0]
    device = dest.device
    by_weight = torch.sort(weights_flat.detach(), descending=True, stable=True).indices
    order = by_weight[torch.sort(dest[by_weight], stable=True).indices]
    per_dest = torch.zeros(num_ranks, dtype=torch.int64, device=device).scatter_add_(0, dest, torch.ones_like(dest))
    first = per_dest.cumsum(0) - per_dest
    position = torch.empty_like(order).scatter_(0, order, torch.arange(slots, device=device) - first[dest[order]])
    keep = position < capacity
    buffer_index = torch.where(keep, dest * capacity + position, num_ranks * capacity)
    return buffer_index, keep


# ---------------------------------------------------------------------------------------------
# The dispatcher


@dataclass
class DispatchInfo:
    """What one dispatch did (device tensors; read them after the step, not on the dispatch path)."""

    keep: torch.Tensor  # [s, k] bool: slot reached its expert
    dest: torch.Tensor  # [s, k] EP rank each slot was sent to (home or replica holder)
    dropped: torch.Tensor  # () int64
    received: torch.Tensor  # () int64 slots this rank's experts computed
    replicas: torch.Tensor  # () int64 replica placements in the EP group (0 in capacity mode)
    plan: Optional[ReplicaPlan]
    capacity: int


class ExpertParallel:
    """Experts of every MoE layer split over one EP group; stateless across layers and steps."""

    def __init__(self, group: Group, num_experts: int, mode: Mode = "balanced", capacity_factor: float = 1.25,
                 max_replicas_per_rank: int = 2, compute: Compute = "grouped"):
        if num_experts % group.size:
            raise ValueError(f"num_experts={num_experts} is not divisible by ep={group.size}")
        if mode not in ("balanced", "capacity"):
            raise ValueError(f"expert_dispatch must be 'balanced' or 'capacity', got {mode!r}")
        self.group = group
        self.num_experts = num_experts
        self.mode = mode
        self.capacity_factor = capacity_factor
        self.max_replicas = max_replicas_per_rank if mode == "balanced" else 0
        self.compute = compute

    @classmethod
    def from_state(cls, state, parallel_config, num_experts: int,
                   compute: Compute = "grouped") -> Optional["ExpertParallel"]:
        """The dispatcher for `state.ep`, or None when `ep == 1` (experts replicated: the
        single-process path)."""
        if state.ep.size == 1:
            return None
        if state.layout.tp > 1 and not state.sequence_parallel:
            raise ValueError(
                f"parallel.ep={state.ep.size} with parallel.tp={state.layout.tp} needs "
                "parallel.sequence_parallel=true: without it every tensor-parallel rank routes the same tokens "
                "and each would be dispatched tp times")
        return cls(state.ep, num_experts, parallel_config.expert_dispatch, parallel_config.capacity_factor,
                   parallel_config.max_replicas_per_rank, compute)

    # ------------------------------------------------------------------ layout
    @property
    def size(self) -> int:
        return self.group.size

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.size

    @property
    def expert_offset(self) -> int:
        return self.rank * self.num_local_experts

    def capacity(self, tokens: int, top_k: int) -> int:
        return capacity_per_pair(tokens, top_k, self.size, self.capacity_factor)

    def buffer_shapes(self, tokens: int, top_k: int, latent: int, inner: int) -> dict[str, tuple[int, ...]]:
        """Every buffer that crosses ranks, as a function of the config and micro-batch size."""
        r, c = self.size, self.capacity(tokens, top_k)
        shapes = {"dispatch": (r, c, latent), "dispatch_ids": (r, c), "combine": (r, c, latent)}
        if self.mode == "balanced":
            shapes["slot_counts"] = (r, self.num_experts)
            shapes["replica_weights"] = (r, self.max_replicas, 3 * inner * latent)
        return shapes

    def mark_expert_params(self, experts: GroupedExperts) -> None:
        """Tag this rank's expert stacks: distinct across `ep`, replicated over `expert_dp`."""
        for param in (experts.w1, experts.w3, experts.w2):
            param.expert_parallel = True
            param.expert_offset = self.expert_offset
            param.num_global_experts = self.num_experts
            param.full_shape = (self.num_experts, *param.shape[1:])
            # Checkpoints store the stack as one tensor of all experts, sharded over `ep`.
            param.shard_group = self.group
            param.partition_dim = 0

    # ------------------------------------------------------------------ forward
    def __call__(self, latent: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                 experts: GroupedExperts) -> tuple[torch.Tensor, DispatchInfo]:
        """`latent [s, l]`, `expert_ids [s, k]` (global ids), `weights [s, k]` → `Σ_k p·E(latent)`
        `[s, l]` in `latent`'s dtype, and what the dispatch did."""
        tokens, top_k = expert_ids.shape
        width = latent.shape[-1]
        num_ranks, local = self.size, self.num_local_experts
        capacity = self.capacity(tokens, top_k)
        expert_flat = expert_ids.reshape(-1)
        weights_flat = weights.reshape(-1)

        plan = None
        if self.mode == "balanced":
            with torch.no_grad():
                mine = torch.zeros(self.num_experts, dtype=torch.int64, device=latent.device).scatter_add_(
                    0, expert_flat, torch.ones_like(expert_flat))
                counts = self.group.all_gather(mine.view(1, -1), dim=0)  # [R, E], a few KB
                plan = plan_replicas(counts, self.max_replicas)
                dest, local_id = balanced_route(expert_flat, counts, self.rank, plan)
        else:
            dest, local_id = home_route(expert_flat, local)
        buffer_index, keep = pack_slots(dest, weights_flat, num_ranks, capacity)

        # dispatch: [R·C (+ trash), l] rows and ids, one all-to-all each
        slot_latent = latent.unsqueeze(1).expand(tokens, top_k, width).reshape(-1, width)
        send = latent.new_zeros(num_ranks * capacity + 1, width).index_copy(0, buffer_index, slot_latent)
        send_ids = torch.full((num_ranks * capacity + 1,), -1, dtype=torch.int32, device=latent.device)
        send_ids = send_ids.index_copy(0, buffer_index, local_id.to(torch.int32))
        received = all_to_all(send[:-1].view(num_ranks, capacity, width), self.group)
        received_ids = self.group.all_to_all(send_ids[:-1].view(num_ranks, capacity)).long()

        # local experts (home, then replica slots), outputs in the received slots
        rows = received.view(-1, width)
        ids = received_ids.view(-1)
        output = experts.grouped_forward(rows, ids, compute=self.compute)
        if plan is not None:
            replicas = self.fetch_replicas(experts, plan)
            output = output + experts.grouped_forward(rows, ids - local, replicas, compute=self.compute)

        # combine: back to the source, gather per slot (dropped slots read the zero trash row)
        returned = all_to_all(output.view(num_ranks, capacity, width), self.group).reshape(-1, width)
        returned = torch.cat([returned, returned.new_zeros(1, width)])
        slot_output = returned.index_select(0, buffer_index)
        wide = torch.promote_types(slot_output.dtype, torch.float32)
        routed = (slot_output.to(wide) * weights_flat.to(wide)[:, None]).view(tokens, top_k, width).sum(1)

        info = DispatchInfo(
            keep=keep.view(tokens, top_k), dest=dest.view(tokens, top_k), dropped=(~keep).sum(),
            received=(received_ids >= 0).sum(),
            replicas=(plan.num_replicas if plan is not None
                      else torch.zeros((), dtype=torch.int64, device=latent.device)),
            plan=plan, capacity=capacity,
        )
        return routed.to(latent.dtype), info

    def fetch_replicas(self, experts: GroupedExperts, plan: ReplicaPlan) -> ExpertStacks:
        """This step's replica weights `[M, …]` (zeros in unused slots), from their home ranks; in
        backward their gradients flow back into the home experts' gradients."""
        num_ranks, local, slots = self.size, self.num_local_experts, self.max_replicas
        # send[d, m] = weights of the expert rank d hosts in replica slot m, if this rank is its home
        grid = torch.full((num_ranks, slots), -1, dtype=torch.int64, device=plan.expert.device)
        target = torch.where(plan.valid, plan.dest * slots + plan.slot, num_ranks * slots)
        grid = torch.cat([grid.view(-1), grid.new_full((1,), -1)]).index_copy(0, target, plan.expert)[:-1]
        grid = grid.view(num_ranks, slots)
        ours = (grid >= self.expert_offset) & (grid < self.expert_offset + local)
        index = torch.where(ours, grid - self.expert_offset, 0).view(-1)
        shapes = [w.shape[1:] for w in (experts.w1, experts.w3, experts.w2)]
        pieces = [w.index_select(0, index).reshape(num_ranks * slots, -1) for w in (experts.w1, experts.w3, experts.w2)]
        send = torch.cat(pieces, dim=1).view(num_ranks, slots, -1)
        send = torch.where(ours[:, :, None], send, torch.zeros_like(send))
        received = all_to_all(send, self.group).sum(0)  # [M, F]: one home (or none) per slot
        sizes = [math.prod(shape) for shape in shapes]
        w1, w3, w2 = (part.reshape(slots, *shape) for part, shape in zip(received.split(sizes, dim=1), shapes))
        return w1, w3, w2
