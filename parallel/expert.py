"""Expert parallelism: fixed-size all-to-all dispatch in the latent width.

The routed experts of a MoE layer are split over `state.ep` (each rank holds its *home* experts
as stacks); the MoE layer hands the dispatcher latent token slots with expert ids and routing
weights and gets `Σ_k p_k · E_k(latent)` back per token. Buffer shapes depend only on the config
and the micro-batch size (CUDA-graph safe). `balanced` mode (the default) hosts replicas of hot
experts, planned per micro-batch from its own all-gathered loads (`online`,
`parallel/expert_replicas.py`) or once per step (`step`), and keeps every rank under a
per-destination capacity; the token rows travel through a transport behind one interface
(`parallel/expert_transports.py`: `exact`, the GPU default, the rows that exist into a fixed
receive buffer with device split sizes; `spread`, the GPU default without NVSHMEM, two
fixed-shape hops that never drop while destinations are within capacity; `relay`, two hops within `capacity_factor` of the
unpadded bytes; `padded`; `splits`, the gloo default; `nodes`, once per destination node,
`parallel/expert_nodes.py`); `capacity` mode sends each slot home through per-pair buffers and
drops overflow. The experts compute through their own module
(`SupportsGroupedForward.grouped_forward`). Planning: `parallel/expert_plan.py`; layout, replicas,
gradients and statistics: docs/expert_parallel.md.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol, cast

import torch
import torch.distributed as dist
from torch import nn

from k3train.parallel.comm import Group
from k3train.parallel.device_splits import nvshmem_usable
from k3train.parallel.expert_exchange import Phases, run_phases
from k3train.parallel.expert_placement import ReplicaPlacement, top_up_placement
from k3train.parallel.expert_plan import (  # noqa: F401  (re-exported: the planner's public names)
    RelayCapacity,
    RelayPlan,
    ReplicaPlan,
    apply_placement,
    capacity_per_destination,
    capacity_per_pair,
    destination_room,
    greedy_plan_from_load,
    home_route,
    pack_slots,
    pair_positions,
    pair_slots,
    plan_from_load,
    plan_relay,
    plan_replicas,
    proportional_pairs,
    proportional_route,
    proportional_shares,
    relay_capacity,
    relay_forward,
    relay_route,
    replica_route,
)
from k3train.parallel.expert_replicas import StepAndTopUps, StepOnly, start_fetch
from k3train.parallel.expert_spread import spread_capacity
from k3train.parallel.expert_step_replicas import StepReplicaCache, StepReplicas, building_graph
from k3train.parallel.expert_transports import TRANSPORT_CLASSES, weighted_sum

Mode = Literal["balanced", "capacity"]
Compute = Literal["grouped", "gather"]
Transport = Literal["spread", "relay", "padded", "splits", "exact", "nodes"]
TRANSPORTS = ("spread", "relay", "padded", "splits", "exact", "nodes")
ReplicaPlanning = Literal["online", "step"]


def resolve_transport(configured: str, backend: str, device_splits: bool = True) -> Transport:
    """`parallel.ep_transport: auto` → `splits` on gloo (tensors live in host memory, so reading
    the split sizes costs no device synchronisation, and the exact receive layout never drops);
    on GPU back-ends `exact` where the all-to-all can take its split sizes on the device
    (`device_splits`: NVSHMEM, which torch's CUDA wheels ship; a plan, which has no group,
    assumes it): the rows that exist into a fixed receive buffer, static shapes, no host read;
    else `spread` (static shapes, no host read, about twice the rows; both drop nothing while
    every destination is within its capacity, which the replica planner ensures)."""
    if configured == "auto":
        if backend == "gloo":
            return "splits"
        return "exact" if device_splits else "spread"
    if configured not in TRANSPORTS:
        raise ValueError(f"parallel.ep_transport must be 'auto' or one of {TRANSPORTS}, got {configured!r}")
    return configured  # type: ignore[return-value]


def resolve_gpus_per_node(configured: int) -> int:
    """`parallel.gpus_per_node: 0` → torchrun's local world size (1 without torchrun)."""
    return configured if configured > 0 else int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


ExpertStacks = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""An experts module's weights `(w1, w3, w2)`: `[G, I, l]`, `[G, I, l]`, `[G, l, I]`."""


class SupportsGroupedForward(Protocol):
    """What the dispatcher needs of a layer's experts module (the model's `GroupedExperts`): the
    weight stacks it marks and fetches replicas of, and the module's own computation."""

    w1: nn.Parameter  # [G, I, l]
    w3: nn.Parameter  # [G, I, l]
    w2: nn.Parameter  # [G, l, I]

    def stacks(self) -> ExpertStacks: ...

    def grouped_forward(
        self, rows: torch.Tensor, ids: torch.Tensor, weights: ExpertStacks | None = None, compute: str = "grouped"
    ) -> torch.Tensor:
        """Each row through expert `ids[row]` (other ids: zero rows), with `weights` (stacks
        `(w1, w3, w2)`) instead of the module's own when given."""
        ...


def routing_statistics_group(state) -> Group:
    """The ranks whose routing statistics one balancer update combines: all that route distinct
    tokens through a layer (data-parallel ranks, and tensor-parallel ranks under sequence
    parallelism). The expert-parallel group is inside it."""
    return state.data_tensor if state.sequence_parallel else state.dp


# ---------------------------------------------------------------------------------------------
# The dispatcher


class ExpertParameter(Protocol):
    """The marks of a rank's expert stack (attributes torch does not declare, set by
    `ExpertParallel.mark_expert_params`): experts `expert_offset` … of `num_global_experts`, and
    the sharding the checkpoints read (`parallel.tensor.ShardedParameter`)."""

    expert_parallel: bool
    expert_offset: int
    num_global_experts: int
    full_shape: tuple[int, ...]
    shard_group: Group
    partition_dim: int


@dataclass
class DispatchInfo:
    """What one dispatch did (device tensors; read them after the step, not on the dispatch path)."""

    keep: torch.Tensor  # [s, k] bool: slot reached its expert
    dest: torch.Tensor  # [s, k] EP rank each slot was sent to (home or replica holder)
    dropped: torch.Tensor  # () int64
    received: torch.Tensor  # () int64 slots this rank's experts computed
    replicas: torch.Tensor  # () int64 replica placements in the EP group (0 in capacity mode)
    plan: ReplicaPlan | None
    capacity: int
    wire_bytes: torch.Tensor  # () int64 token bytes this rank sends, dispatch + combine, forward + backward
    replica_bytes: torch.Tensor  # () int64 replica bytes this rank sends this step (counted once)


class ExpertParallel:
    """Experts of every MoE layer split over one EP group. Per layer it keeps the step's replica
    placement and weights (`step` planning; their gradients go home in the step's last
    backward); `finish_step` (after gradient reduction) plans the next step."""

    def __init__(
        self,
        group: Group,
        num_experts: int,
        mode: Mode = "balanced",
        capacity_factor: float = 1.25,
        max_replicas_per_rank: int = 2,
        compute: Compute = "grouped",
        transport: Transport = "relay",
        replica_tolerance: float = 0.05,
        spare_replicas: bool = True,
        replica_planning: ReplicaPlanning = "online",
        gpus_per_node: int = 0,
        overlap_chunks: int = 0,
        top_up_replicas: int = 0,
        overlap_halves: bool = False,
    ):
        if num_experts % group.size:
            raise ValueError(f"num_experts={num_experts} is not divisible by ep={group.size}")
        if mode not in ("balanced", "capacity"):
            raise ValueError(f"expert_dispatch must be 'balanced' or 'capacity', got {mode!r}")
        if transport not in TRANSPORTS:
            raise ValueError(f"parallel.ep_transport must be one of {TRANSPORTS}, got {transport!r}")
        if overlap_chunks < 0:
            raise ValueError(
                f"parallel.ep_overlap_chunks must be 0 (no overlap) or a number of chunks, got {overlap_chunks}"
            )
        if replica_planning not in ("online", "step"):
            raise ValueError(f"parallel.ep_replica_planning must be 'online' or 'step', got {replica_planning!r}")
        if top_up_replicas < 0 or (top_up_replicas and replica_planning != "step"):
            raise ValueError(
                f"parallel.ep_top_up_replicas={top_up_replicas}: top-ups are slots after a step placement's, "
                "for ep_replica_planning=step (0 otherwise)"
            )
        self.group = group
        self.num_experts = num_experts
        # `online`: each micro-batch plans its replicas from its own loads and fetches their
        # weights (`parallel/expert_replicas.py`); `step`: one placement per step, planned from
        # the previous step's loads, weights fetched once per step
        self.replica_planning = replica_planning
        self.mode = mode
        self.capacity_factor = capacity_factor
        self.max_replicas = max_replicas_per_rank if mode == "balanced" else 0
        # `step` planning: this many more replica slots per rank, planned per micro-batch where
        # the step's placement would leave a rank past its capacity (`top_up_placement`)
        self.top_up = top_up_replicas if mode == "balanced" else 0
        self.compute = compute
        self.transport = transport
        self.token_transport = TRANSPORT_CLASSES[transport](group, capacity_factor, gpus_per_node)
        # the device-split transport's counted exchange also fetches `online` replicas: only the
        # replicated matrices travel (others: one equal-split all-to-all of `[R, M, F]`)
        self.counted_replicas = getattr(self.token_transport, "exchange", None)
        self.replica_tolerance = replica_tolerance
        self.spare_replicas = spare_replicas  # fill free replica slots with the next hottest experts
        # > 0: the tokens in this many chunks whose all-to-alls travel under other chunks' experts
        self.overlap_chunks = overlap_chunks if mode == "balanced" else 0
        # the model runs each micro-batch as two halves whose layers alternate, so that one
        # half's exchanges travel under the other half's compute (`K3ModelChunk.forward_layers`)
        self.overlap_halves = overlap_halves and self.overlap_chunks > 0
        # `step` planning's per-layer replicas and the checkpoint's placements
        # (`parallel/expert_step_replicas.py`; with `online` it only keeps the layers' order)
        self.step_cache = StepReplicaCache(
            group,
            num_experts,
            self.max_replicas,
            replica_tolerance,
            spare_replicas,
            planned=replica_planning == "step" and mode == "balanced" and group.size > 1,
        )

    @classmethod
    def from_state(
        cls, state, parallel_config, num_experts: int, compute: Compute = "grouped"
    ) -> ExpertParallel | None:
        """The dispatcher for `state.ep`, or None when `ep == 1` (experts replicated: the
        single-process path)."""
        if state.ep.size == 1:
            return None
        if state.layout.tp > 1 and not state.sequence_parallel:
            raise ValueError(
                f"parallel.ep={state.ep.size} with parallel.tp={state.layout.tp} needs "
                "parallel.sequence_parallel=true: without it every tensor-parallel rank routes the same tokens "
                "and each would be dispatched tp times"
            )
        # A plan has no process groups: it prices the transport a GPU cluster would run.
        backend = dist.get_backend(state.ep.process_group) if state.ep.process_group is not None else "nccl"
        device_splits = state.ep.process_group is None or nvshmem_usable(state.ep)
        transport = resolve_transport(getattr(parallel_config, "ep_transport", "auto"), backend, device_splits)
        return cls(
            state.ep,
            num_experts,
            parallel_config.expert_dispatch,
            parallel_config.capacity_factor,
            parallel_config.max_replicas_per_rank,
            compute,
            transport=transport,
            replica_planning=getattr(parallel_config, "ep_replica_planning", "online"),
            gpus_per_node=resolve_gpus_per_node(getattr(parallel_config, "gpus_per_node", 0)),
            overlap_chunks=getattr(parallel_config, "ep_overlap_chunks", 0),
            top_up_replicas=getattr(parallel_config, "ep_top_up_replicas", 0),
            overlap_halves=getattr(parallel_config, "ep_overlap_halves", False),
        )

    # ------------------------------------------------------------------ layout
    @property
    def size(self) -> int:
        return self.group.size

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def replica_slots(self) -> int:
        """Replica slots per rank: the placement's (or `online` plan's) and the top-ups after them."""
        return self.max_replicas + self.top_up

    @property
    def overlaps(self) -> bool:
        """Whether `__call__` runs the caller's `alongside` work under its all-to-alls."""
        return self.overlap_chunks > 0

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.size

    @property
    def expert_offset(self) -> int:
        return self.rank * self.num_local_experts

    def capacity(self, tokens: int, top_k: int) -> int:
        """`capacity`: slots per (source, destination) pair; `balanced`: rows per destination."""
        if self.mode == "balanced":
            return capacity_per_destination(tokens, top_k, self.size, self.capacity_factor)
        return capacity_per_pair(tokens, top_k, self.size, self.capacity_factor)

    def buffer_shapes(self, tokens: int, top_k: int, latent: int, inner: int) -> dict[str, tuple[int, ...]]:
        """Every buffer that crosses ranks or holds received rows, as a function of the config and
        micro-batch size: fixed shapes for `padded`, `relay` and `spread`; `splits` sends exactly its
        `s·k` slot rows and, under balanced loads, receives and returns as many (the `nodes`
        transport's rows are priced by `planning/layout_traffic.node_layer_traffic`)."""
        r, c = self.size, self.capacity(tokens, top_k)
        if self.mode == "capacity":
            return {"dispatch": (r, c, latent), "dispatch_ids": (r, c), "combine": (r, c, latent)}
        replica_weights: tuple[int, ...] = (self.max_replicas, 3 * inner * latent)
        if self.replica_planning == "online":  # the per-micro-batch exchange of the planned replicas
            replica_weights = (r, self.max_replicas, 3 * inner * latent)
        top_up = {"top_up_weights": (r, self.top_up, 3 * inner * latent)} if self.top_up else {}
        if self.transport in ("spread", "relay"):  # two fixed-shape hops: to a forwarder, then on
            if self.transport == "spread":
                spread = spread_capacity(tokens * top_k, r, c)
                first, second, received = spread.first, spread.second, r * spread.second
            else:
                hop = relay_capacity(tokens, top_k, r, self.capacity_factor)
                first, second, received = hop.first, hop.second, r * hop.rows
            return {
                "dispatch": (r, first, latent),
                "dispatch_ids": (r, first),
                "forward": (r, second, latent),
                "forward_ids": (r, second),
                "combine_forwarded": (r, second, latent),
                "combine": (r, first, latent),
                "received": (received, latent),
                "slot_counts": (r, self.num_experts),
                "replica_weights": replica_weights,
                **top_up,
            }
        pair = tokens * top_k
        if self.transport in ("splits", "exact", "nodes"):  # the s·k slot rows that exist, and as many back
            return {
                "dispatch": (pair, latent),
                "dispatch_ids": (pair,),
                "combine": (pair, latent),
                "received": (c, latent),
                "slot_counts": (r, self.num_experts),
                "replica_weights": replica_weights,
                **top_up,
            }
        return {
            "dispatch": (r, pair, latent),
            "dispatch_ids": (r, pair),
            "combine": (r, pair, latent),
            "received": (c, latent),
            "slot_counts": (r, self.num_experts),
            "replica_weights": replica_weights,
            **top_up,
        }

    def mark_expert_params(self, experts: SupportsGroupedForward) -> None:
        """Tag this rank's expert stacks: distinct across `ep`, replicated over `expert_dp`."""
        for param in (experts.w1, experts.w3, experts.w2):
            marks = cast(ExpertParameter, param)
            marks.expert_parallel = True
            marks.expert_offset = self.expert_offset
            marks.num_global_experts = self.num_experts
            marks.full_shape = (self.num_experts, *param.shape[1:])
            # Checkpoints store the stack as one tensor of all experts, sharded over `ep`.
            marks.shard_group = self.group
            marks.partition_dim = 0
        self.step_cache.mark(experts)

    # ------------------------------------------------------------------ forward
    def __call__(
        self,
        latent: torch.Tensor,
        expert_ids: torch.Tensor,
        weights: torch.Tensor,
        experts: SupportsGroupedForward,
        alongside: Callable[[], None] | None = None,
    ) -> tuple[torch.Tensor, DispatchInfo]:
        """`latent [s, l]`, `expert_ids [s, k]` (global ids), `weights [s, k]` → `Σ_k p·E(latent)`
        `[s, l]` in `latent`'s dtype, and what the dispatch did. `alongside` (work independent of
        the routed experts, as the shared experts) is called exactly once: while the first
        dispatch is on the wire when the dispatcher `overlaps`, else after the combine."""
        return run_phases(self.dispatch_phases(latent, expert_ids, weights, experts, alongside))

    def dispatch_phases(
        self,
        latent: torch.Tensor,
        expert_ids: torch.Tensor,
        weights: torch.Tensor,
        experts: SupportsGroupedForward,
        alongside: Callable[[], None] | None = None,
    ) -> Phases[tuple[torch.Tensor, DispatchInfo]]:
        """`__call__` as a phase generator: when the dispatcher `overlaps` it yields while its
        exchanges are on the wire (`parallel/expert_overlap.py`), so that a caller runs other
        independent work there (the other half of the micro-batch); otherwise it never yields."""
        tokens, top_k = expert_ids.shape
        width = latent.shape[-1]
        expert_flat = expert_ids.reshape(-1)
        weights_flat = weights.reshape(-1)
        slot_latent = latent.unsqueeze(1).expand(tokens, top_k, width).reshape(-1, width)
        if self.mode == "balanced" and self.overlaps:
            from k3train.parallel.expert_overlap import overlapped_dispatch  # it builds this module's DispatchInfo

            routed, info = yield from overlapped_dispatch(
                self, slot_latent, expert_flat, weights_flat, experts, top_k, alongside
            )
        else:
            if self.mode == "balanced":
                routed, info = self._balanced(slot_latent, expert_flat, weights_flat, experts, top_k)
            else:
                slot_output, info = self._capacity(slot_latent, expert_flat, weights_flat, experts)
                routed = weighted_sum(slot_output, weights_flat, top_k)
            if alongside is not None:
                alongside()
        info.keep, info.dest = info.keep.view(tokens, top_k), info.dest.view(tokens, top_k)
        return routed.to(latent.dtype), info

    def _capacity(self, slot_latent, expert_flat, weights_flat, experts):
        """Per-pair buffers `[R, C_pair]`: every slot to its home rank, overflow dropped
        (`parallel/expert_capacity.py`)."""
        from k3train.parallel.expert_capacity import capacity_dispatch  # it builds this module's DispatchInfo

        return capacity_dispatch(self, slot_latent, expert_flat, weights_flat, experts)

    def _balanced(self, slot_latent, expert_flat, weights_flat, experts, top_k: int):
        """Plan (replicas and each slot's holder), fetch the replicas, then the transport:
        `dispatch`, the local experts, `combine`."""
        num_ranks = self.size
        slots, device = expert_flat.shape[0], slot_latent.device
        capacity = capacity_per_destination(slots, 1, num_ranks, self.capacity_factor)
        # `online` keeps nothing across micro-batches; `step` the step's placement, loads and weights
        state = self._layer(experts, device) if self.replica_planning == "step" else None
        training = building_graph()  # loads of a training forward plan the next step's replicas
        with torch.no_grad():
            mine = torch.zeros(self.num_experts, dtype=torch.int64, device=device).scatter_add_(
                0, expert_flat, torch.ones_like(expert_flat)
            )
            counts = self.group.all_gather(mine.view(1, -1), dim=0)  # [R, E], a few KB
            if state is None:  # this micro-batch's own loads place its replicas
                plan = plan_from_load(counts.sum(0), num_ranks, self.max_replicas)
            else:
                if training:
                    state.load += counts.sum(0)
                placement = self._topped_up(counts, state.placement, capacity)
                plan = apply_placement(counts, placement, capacity)
            dest, local_id, pairs = self.token_transport.route(expert_flat, counts, plan)
        replicas, replica_bytes = self._replicas(experts, state, plan)
        delivery = self.token_transport.dispatch(slot_latent, weights_flat, dest, local_id, pairs, capacity, top_k)
        output = self._experts(delivery.rows, delivery.ids, experts, replicas)
        routed = self.token_transport.combine_weighted(output, delivery, weights_flat, top_k)
        keep = delivery.keep
        info = DispatchInfo(
            keep,
            dest,
            (~keep).sum(),
            (delivery.ids >= 0).sum(),
            plan.num_replicas,
            plan,
            capacity,
            delivery.wire_bytes,
            torch.as_tensor(replica_bytes, dtype=torch.int64, device=keep.device),
        )
        return routed, info

    def _replicas(
        self, experts: SupportsGroupedForward, state: StepReplicas | None, plan: ReplicaPlan
    ) -> tuple[ExpertStacks, int]:
        """The replica stacks this micro-batch computes with and the replica bytes it sends: fetched
        now for `plan` (`online`), or the step's cached ones (`step`; their traffic counted with
        the micro-batch that fetched them)."""
        stacks, sent_bytes = self._start_replicas(experts, state, plan).finish()
        return cast(ExpertStacks, stacks), sent_bytes

    def _start_replicas(
        self, experts: SupportsGroupedForward, state: StepReplicas | None, plan: ReplicaPlan | ReplicaPlacement
    ):
        """`_replicas` in two parts: the fetch launched now, its `finish()` waiting for it
        (`online`: this micro-batch's replicas; `step`: the step's, in flight at the layer's first
        dispatch of the step, cached after)."""
        if state is None:
            return start_fetch(experts.stacks(), plan, self.group, self.max_replicas, self.counted_replicas)
        replicas = self.step_cache.start(experts)  # the step's first dispatch of the layer: in flight
        sent_bytes, state.fetch_bytes = state.fetch_bytes, 0
        if not self.top_up:
            return StepOnly(replicas, sent_bytes)
        # the top-up entries (after the placement's R·M), in slots 0 … T − 1 of their own stacks
        placed = self.size * self.max_replicas
        top_ups = ReplicaPlacement(
            plan.expert[placed:], plan.dest[placed:], plan.slot[placed:] - self.max_replicas, plan.valid[placed:]
        )
        pending = start_fetch(experts.stacks(), top_ups, self.group, self.top_up, self.counted_replicas)
        return StepAndTopUps(replicas, pending, sent_bytes)

    def _topped_up(self, counts: torch.Tensor, placement: ReplicaPlacement, capacity: int) -> ReplicaPlacement:
        """The step's placement, with this micro-batch's top-ups after it when there are top-up slots."""
        if not self.top_up:
            return placement
        return top_up_placement(counts, placement, capacity, self.top_up, self.capacity_factor - 1)

    def _experts(self, rows, ids, experts, replicas: ExpertStacks) -> torch.Tensor:
        """Received rows through the home experts, then the replica slots (ids `G … G + M − 1`)."""
        output = experts.grouped_forward(rows, ids, compute=self.compute)
        return output + experts.grouped_forward(rows, ids - self.num_local_experts, replicas, compute=self.compute)

    # ------------------------------------------------------------------ replicas, once per step
    def _layer(self, experts: SupportsGroupedForward, device=None) -> StepReplicas:
        return self.step_cache.layer(experts, device)

    def one_micro_batch(self):
        """A context: the dispatches inside are one micro-batch's halves (`parallel.ep_overlap_halves`),
        whose `step` replicas return their gradients home together (`StepReplicaCache.one_micro_batch`)."""
        return self.step_cache.one_micro_batch()

    def set_last_micro_batch(self, last: bool) -> None:
        """True (the default): the next backward is the step's last through these layers, and
        returns the `step` replicas' gradients to their home experts (the pipeline schedule says
        it, as it tells the gradient reducer); False: they accumulate on the replicas."""
        self.step_cache.last_micro_batch = last

    def step_replicas(self, experts: SupportsGroupedForward) -> ExpertStacks:
        """This step's replica weights `[M, …]` (zeros in unused slots): fetched from their home
        ranks at the layer's first dispatch of the step and kept for every micro-batch; their
        gradients return home in the step's last backward (`expert_step_replicas.py`). Exact
        splits: each placed replica moves once (a host list decided at the step boundary, not on
        the dispatch path)."""
        return cast(ExpertStacks, self.step_cache.replicas(experts))

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """The next step's replica placement of every layer (planned by `finish_step`), as JSON
        values: `layers[i]` lists `[expert, rank, slot]` for the `i`-th experts module marked on this
        rank. Saved per rank (`k3train.checkpoint.PerRank`): the EP groups of a job plan apart."""
        return self.step_cache.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restore the placements `state_dict` saved, so a resumed step hosts the same replicas (and
        sums replica gradients in the same order) as the uninterrupted run; a checkpoint of another
        `ep` or `max_replicas_per_rank` warns and the first step places none."""
        self.step_cache.load_state_dict(state)

    def finish_step(self, state=None) -> None:
        """At the step boundary, after the gradient reduction: plan each layer's next replicas from
        this step's loads and drop the step's replica weights. Their gradients went home in the
        step's last backward (`set_last_micro_batch`), before the reduction; gradients that no
        backward marked last returned are added here, which is exact only where the reduction has
        nothing to add them to across EP groups (`state` None, as in the dispatcher's own tests,
        or `expert_dp` of one rank)."""
        self.step_cache.finish_step(state)
