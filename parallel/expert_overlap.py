"""The overlapped schedule of one MoE layer's expert exchange (`parallel.ep_overlap_chunks`):
the tokens in chunks whose all-to-alls travel while the other chunks' experts, and the shared
experts, compute. `ExpertParallel` calls it in place of its one-shot balanced dispatch; the
transports' phase generators and the launch/wait pairs are `parallel/expert_exchange.py`'s."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from k3train.parallel.expert import DispatchInfo
from k3train.parallel.expert_exchange import Phased, Phases
from k3train.parallel.expert_placement import ReplicaPlacement
from k3train.parallel.expert_plan import apply_placement, capacity_per_destination, plan_from_load
from k3train.parallel.expert_step_replicas import building_graph
from k3train.parallel.tensor_overlap import chunk_bounds

if TYPE_CHECKING:
    from k3train.parallel.expert import ExpertParallel

EXCHANGE = "exchange"
"""What `overlapped_dispatch` yields: its exchanges are on the wire."""


def overlapped_dispatch(
    ep: ExpertParallel, slot_latent, expert_flat, weights_flat, experts, top_k: int, alongside
) -> Phases[tuple[torch.Tensor, DispatchInfo]]:
    """`ExpertParallel._balanced` with the tokens in `overlap_chunks` chunks (fewer when there are fewer
    tokens), each planned from its own loads under one replica placement (the micro-batch's:
    `online` plans it from the whole micro-batch's loads, so the replicas are fetched once).
    Every chunk's first hop is launched at once, then `alongside` runs; chunk `i`'s experts run
    while chunk `i + 1`'s rows and chunk `i − 1`'s combine travel
    (`parallel/expert_exchange.py`: the backward overlaps the same way).

    A phase generator (`run_phases` runs it at once): it yields `EXCHANGE` once the first hops
    are on the wire (after `alongside`) and once the last combine is, so that a caller with
    other independent work (the other half of the micro-batch, `parallel.ep_overlap_halves`)
    runs it there (a two-hop transport's second hops go on as without halves: launched when
    their chunk's first hop is waited for). It returns `(routed, info)`."""
    num_ranks, num_experts = ep.size, ep.num_experts
    tokens, device = expert_flat.shape[0] // top_k, slot_latent.device
    bounds = chunk_bounds(tokens, ep.overlap_chunks)
    slot_ranges = [(start * top_k, end * top_k) for start, end in bounds]
    capacities = [capacity_per_destination(end - start, 1, num_ranks, ep.capacity_factor) for start, end in slot_ranges]
    state = ep._layer(experts, device) if ep.replica_planning == "step" else None
    training = building_graph()
    with torch.no_grad():
        chunk_of_slot = torch.cat(
            [
                torch.full((end - start,), c, dtype=torch.int64, device=device)
                for c, (start, end) in enumerate(slot_ranges)
            ]
        )
        mine = torch.zeros(len(bounds) * num_experts, dtype=torch.int64, device=device).scatter_add_(
            0, chunk_of_slot * num_experts + expert_flat, torch.ones_like(expert_flat)
        )
        counts = ep.group.all_gather(mine.view(1, -1), dim=0).view(num_ranks, len(bounds), num_experts)
        load = counts.sum((0, 1))
        if state is None:
            whole = plan_from_load(load, num_ranks, ep.max_replicas)
            placement = ReplicaPlacement.from_plan(whole)
        else:
            if training:
                state.load += load
            # top-ups (if any) from the whole micro-batch's loads, fetched once for every chunk
            placement = ep._topped_up(counts.sum(1), state.placement, sum(capacities))
        plans = [apply_placement(counts[:, c], placement, capacities[c]) for c in range(len(bounds))]
        routes = [
            ep.token_transport.route(expert_flat[start:end], counts[:, c], plans[c])
            for c, (start, end) in enumerate(slot_ranges)
        ]
    # `online`: the replicas' weights travel with the first hops and under the shared experts
    pending = ep._start_replicas(experts, state, whole if state is None else placement)
    dispatches = [
        Phased(
            ep.token_transport.dispatch_phases(
                slot_latent[start:end], weights_flat[start:end], *routes[c], capacities[c], top_k
            )
        ).start()
        for c, (start, end) in enumerate(slot_ranges)
    ]
    if alongside is not None:
        alongside()  # under the first chunk's dispatch
    yield EXCHANGE  # the other half's work, if any, under the rest of the dispatch
    replicas, replica_bytes = pending.finish()
    combines: list[Phased[torch.Tensor]] = []
    deliveries = []
    for c, (start, end) in enumerate(slot_ranges):
        delivery = dispatches[c].finish()
        if c + 1 < len(dispatches):
            dispatches[c + 1].advance()  # its next hop on the wire while these experts run
        output = ep._experts(delivery.rows, delivery.ids, experts, replicas)
        combine = ep.token_transport.combine_weighted_phases(output, delivery, weights_flat[start:end], top_k)
        combines.append(Phased(combine).start())
        if c > 0:
            combines[c - 1].advance()
        deliveries.append(delivery)
    yield EXCHANGE  # the other half's work, if any, under the last combines
    routed = torch.cat([combine.finish() for combine in combines])
    keep = torch.cat([delivery.keep for delivery in deliveries])
    info = DispatchInfo(
        keep,
        torch.cat([dest for dest, _, _ in routes]),
        (~keep).sum(),
        torch.stack([(delivery.ids >= 0).sum() for delivery in deliveries]).sum(),
        plans[0].num_replicas,
        plans[0],
        sum(capacities),
        torch.stack([torch.as_tensor(d.wire_bytes, device=keep.device) for d in deliveries]).sum(),
        torch.as_tensor(replica_bytes, dtype=torch.int64, device=keep.device),
    )
    return routed, info


__all__ = ["EXCHANGE", "overlapped_dispatch"]
