"""How `balanced` expert parallelism moves token rows: one interface, six transports.

A transport routes a source's slots to their holders under the micro-batch's replica plan
(`route`), sends them (`dispatch`: the rows and local expert ids this rank's experts receive,
and what its `combine` needs) and brings the expert outputs back into the source's slots
(`combine`). The dispatcher (`parallel/expert.py`) plans, fetches replicas and runs the experts
between the two; it knows nothing of the layouts. Layouts and bounds: docs/expert_parallel.md.

* `exact` (the GPU default): exactly the rows that exist, into a fixed `[C_dest]` buffer, split
  sizes as tensors (NVSHMEM's device-split all-to-all on CUDA, `parallel/device_splits.py`).
* `spread` (the GPU default where NVSHMEM is missing): two fixed-shape hops that deliver every
  slot while every destination is within its capacity (`parallel/expert_spread.py`).
* `relay`: two fixed-shape hops within `capacity_factor` of the unpadded rows; a pair's overflow
  through other ranks' spare rows; drops (counted) past its bound.
* `padded`: one all-to-all of `s·k` rows per pair, received into `[C_dest]` (a reference).
* `splits` (the gloo default): exactly the rows that exist, split sizes read on the host.
* `nodes`: a token's row once per destination node, forwarded inside the node
  (`parallel/expert_nodes.py`), every hop `exact`'s counted exchange.

Another transport (a one-sided or DeepEP-style kernel) implements the same three methods.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

import torch

from k3train.parallel.comm import Group
from k3train.parallel.device_splits import counted_all_to_all
from k3train.parallel.expert_exchange import LAST, MORE, Phases, launch, launch_counted, run_phases
from k3train.parallel.expert_nodes import NodeLayout, node_combine, node_dispatch, node_keep, node_rooms
from k3train.parallel.expert_plan import (
    ReplicaPlan,
    destination_room,
    pack_slots,
    pair_positions,
    pair_slots,
    plan_relay,
    proportional_pairs,
    proportional_route,
    proportional_shares,
    relay_capacity,
    relay_forward,
    relay_route,
    replica_route,
)
from k3train.parallel.expert_spread import plan_spread, spread_capacity, spread_forward, spread_kept, spread_route


def wire_bytes(sent_rows, returned_rows, width: int, element: int) -> torch.Tensor:
    """Token bytes a rank sends for one micro-batch: rows and ids forward, the rows' gradients
    backward (each all-to-all's backward sends what the other one sent forward)."""
    rows = torch.as_tensor(sent_rows + returned_rows, dtype=torch.int64)
    return 2 * rows * width * element + torch.as_tensor(sent_rows, dtype=torch.int64) * 4


def weighted_sum(slot_output: torch.Tensor, weights_flat: torch.Tensor, top_k: int) -> torch.Tensor:
    """`Σ_k p_k · E_k` per token from the slots' outputs `[s·k, l]` (accumulated in at least fp32)."""
    wide = torch.promote_types(slot_output.dtype, torch.float32)
    weighted = slot_output.to(wide) * weights_flat.to(wide)[:, None]
    return weighted.view(-1, top_k, slot_output.shape[-1]).sum(1)


@dataclass
class Delivery:
    """What `dispatch` handed this rank's experts and what `combine` needs to bring them back."""

    rows: torch.Tensor  # [N, l] received rows
    ids: torch.Tensor  # [N] int64 local expert id of each row (home `0…G−1`, replica slots `G…`), −1 empty
    keep: torch.Tensor  # [S] bool: this source's slot reached its expert
    wire_bytes: torch.Tensor  # () int64 token bytes this rank sends, dispatch + combine, forward + backward
    saved: tuple[Any, ...]  # the transport's own indices for `combine`


class TokenTransport(abc.ABC):
    """The interface (`route`, `dispatch`, `combine_weighted`); `route` is shared by the
    transports whose only capacity is per destination (each source takes contiguous ranges of a
    replicated expert's slots). A transport writes `dispatch` and `combine_weighted` as phase
    generators (`parallel/expert_exchange.py`: each hop launched, then waited for when resumed):
    the dispatcher runs them at once, or interleaved with other chunks' experts."""

    name = ""

    def __init__(self, group: Group, capacity_factor: float, gpus_per_node: int = 0):
        self.group = group
        self.capacity_factor = capacity_factor

    def route(
        self, expert_flat: torch.Tensor, counts: torch.Tensor, plan: ReplicaPlan
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(dest [S], local_id [S], pairs [R, R])` of this source's slots under `plan`."""
        dest, local_id = replica_route(expert_flat, counts, self.group.rank, plan)
        return dest, local_id, pair_slots(counts, plan)

    def dispatch(self, slot_latent, weights_flat, dest, local_id, pairs, capacity: int, top_k: int) -> Delivery:
        """This source's slots to their experts' ranks: what this rank received."""
        return run_phases(self.dispatch_phases(slot_latent, weights_flat, dest, local_id, pairs, capacity, top_k))

    def combine_weighted(self, output, delivery: Delivery, weights_flat, top_k: int) -> torch.Tensor:
        """`Σ_k p_k · E_k` per token `[s, l]`; a transport may reduce before the rows travel back."""
        return run_phases(self.combine_weighted_phases(output, delivery, weights_flat, top_k))

    @abc.abstractmethod
    def dispatch_phases(
        self, slot_latent, weights_flat, dest, local_id, pairs, capacity: int, top_k: int
    ) -> Phases[Delivery]:
        """`dispatch`, one yield after each hop's launch."""

    @abc.abstractmethod
    def combine_weighted_phases(self, output, delivery: Delivery, weights_flat, top_k: int) -> Phases[torch.Tensor]:
        """`combine_weighted`, one yield after each hop's launch."""


class SlotTransport(TokenTransport):
    """A transport that returns every slot's output to its source, where the weighted sum is made."""

    def combine(self, output: torch.Tensor, delivery: Delivery) -> torch.Tensor:
        """The outputs back into the source's slots `[s·k, l]`."""
        return run_phases(self.combine_phases(output, delivery))

    @abc.abstractmethod
    def combine_phases(self, output: torch.Tensor, delivery: Delivery) -> Phases[torch.Tensor]:
        """`combine`, one yield after each hop's launch."""

    def combine_weighted_phases(self, output, delivery: Delivery, weights_flat, top_k: int) -> Phases[torch.Tensor]:
        slot_output = yield from self.combine_phases(output, delivery)
        return weighted_sum(slot_output, weights_flat, top_k)


class SpreadTransport(SlotTransport):
    """Hop 1 `[R, C1]` spreads each source's slots evenly over all ranks, hop 2 `[R, C2]`
    forwards them to their destinations; combine runs both backwards."""

    name = "spread"

    def dispatch_phases(self, slot_latent, weights_flat, dest, local_id, pairs, capacity: int, top_k: int):
        num_ranks, me, width = self.group.size, self.group.rank, slot_latent.shape[-1]
        device = slot_latent.device
        cap = spread_capacity(slot_latent.shape[0], num_ranks, capacity)
        first_rows, second_rows = num_ranks * cap.first, num_ranks * cap.second
        with torch.no_grad():
            spread = plan_spread(pairs, cap)
            position = pair_positions(dest, weights_flat, num_ranks)
            hop1_index = spread_route(dest, position, me, spread)
            keep = spread_kept(dest, position, me, spread)
            to_hop2, _ = spread_forward(spread, me)  # [R·C1] each received row's hop-2 row (or trash)
            from_hop1 = torch.full((second_rows + 1,), first_rows, dtype=torch.int64, device=device).scatter_(
                0, to_hop2, torch.arange(first_rows, device=device)
            )[:second_rows]  # trash entry sliced off
        zero_row = slot_latent.new_zeros(1, width)
        send = slot_latent.new_zeros(first_rows, width).index_copy(0, hop1_index, slot_latent)
        send_ids = torch.full((first_rows,), -1, dtype=torch.int32, device=device).index_copy(
            0, hop1_index, local_id.to(torch.int32)
        )
        hop1 = launch(send.view(num_ranks, cap.first, width), self.group)
        hop1_ids = launch(send_ids.view(num_ranks, cap.first), self.group)
        yield MORE
        received, received_ids = hop1.result().reshape(-1, width), hop1_ids.result().reshape(-1)
        forward = torch.cat([received, zero_row]).index_select(0, from_hop1)
        forward_ids = torch.cat([received_ids, received_ids.new_full((1,), -1)]).index_select(0, from_hop1)
        hop2 = launch(forward.view(num_ranks, cap.second, width), self.group)
        hop2_ids = launch(forward_ids.view(num_ranks, cap.second), self.group)
        yield LAST
        rows, row_ids = hop2.result().reshape(-1, width), hop2_ids.result().reshape(-1).long()
        wire_rows = num_ranks * cap.rows
        sent = wire_bytes(wire_rows, wire_rows, width, slot_latent.element_size())
        return Delivery(rows, row_ids, keep, sent, (cap, to_hop2, hop1_index))

    def combine_phases(self, output: torch.Tensor, delivery: Delivery):
        cap, to_hop2, hop1_index = delivery.saved
        num_ranks, width = self.group.size, output.shape[-1]
        hop2 = launch(output.view(num_ranks, cap.second, width), self.group)
        yield MORE
        returned = hop2.result().reshape(-1, width)
        back = torch.cat([returned, output.new_zeros(1, width)]).index_select(0, to_hop2)
        hop1 = launch(back.view(num_ranks, cap.first, width), self.group)
        yield LAST
        return hop1.result().reshape(-1, width).index_select(0, hop1_index)


class RelayTransport(SlotTransport):
    """Hop 1 `[R, first]`: each pair's first `direct` slots (highest routing weight) straight to
    their destination, its overflow round robin through other ranks' spare rows; hop 2
    `[R, second]`: each relay forwards what it holds for others. Combine runs the two hops
    backwards. Every rank derives every row's place from the all-gathered counts
    (`parallel/expert_plan.py` `plan_relay`); what no buffer takes is dropped and counted."""

    name = "relay"

    def route(self, expert_flat, counts, plan):
        # a source's slots of an expert split over its holders in proportion to their amounts
        shares = proportional_shares(counts, plan)
        dest, local_id = proportional_route(expert_flat, counts, self.group.rank, plan, shares)
        return dest, local_id, proportional_pairs(counts, plan, shares)

    def dispatch_phases(self, slot_latent, weights_flat, dest, local_id, pairs, capacity: int, top_k: int):
        num_ranks, me, width = self.group.size, self.group.rank, slot_latent.shape[-1]
        slots, device = slot_latent.shape[0], slot_latent.device
        cap = relay_capacity(slots, 1, num_ranks, self.capacity_factor)
        first_rows, second_rows = num_ranks * cap.first, num_ranks * cap.second
        with torch.no_grad():
            relay_plan = plan_relay(pairs, cap)
            hop1_index, keep = relay_route(dest, pair_positions(dest, weights_flat, num_ranks), me, relay_plan)
            to_hop2, direct = relay_forward(relay_plan, me)  # [R·first] each received row's hop-2 row
            from_hop1 = torch.full((second_rows + 1,), first_rows, dtype=torch.int64, device=device).scatter_(
                0, to_hop2, torch.arange(first_rows, device=device)
            )[:second_rows]  # trash entry sliced off
        zero_row = slot_latent.new_zeros(1, width)
        send = torch.cat([slot_latent.new_zeros(first_rows, width), zero_row]).index_copy(0, hop1_index, slot_latent)
        send_ids = torch.full((first_rows + 1,), -1, dtype=torch.int32, device=device).index_copy(
            0, hop1_index, local_id.to(torch.int32)
        )
        hop1 = launch(send[:-1].view(num_ranks, cap.first, width), self.group)
        hop1_ids = launch(send_ids[:-1].view(num_ranks, cap.first), self.group)
        yield MORE
        received, received_ids = hop1.result().reshape(-1, width), hop1_ids.result().reshape(-1)
        forward = torch.cat([received, zero_row]).index_select(0, from_hop1)
        forward_ids = torch.cat([received_ids, received_ids.new_full((1,), -1)]).index_select(0, from_hop1)
        hop2 = launch(forward.view(num_ranks, cap.second, width), self.group)
        hop2_ids = launch(forward_ids.view(num_ranks, cap.second), self.group)
        yield LAST
        relayed, relayed_ids = hop2.result().reshape(-1, width), hop2_ids.result().reshape(-1)
        rows = torch.cat([received, relayed])
        row_ids = torch.cat([torch.where(direct, received_ids, -1), relayed_ids]).long()
        wire_rows = num_ranks * cap.rows
        sent = wire_bytes(wire_rows, wire_rows, width, slot_latent.element_size())
        return Delivery(rows, row_ids, keep, sent, (cap, to_hop2, hop1_index))

    def combine_phases(self, output: torch.Tensor, delivery: Delivery):
        cap, to_hop2, hop1_index = delivery.saved
        num_ranks, width = self.group.size, output.shape[-1]
        first_rows = num_ranks * cap.first
        zero_row = output.new_zeros(1, width)
        hop2 = launch(output[first_rows:].view(num_ranks, cap.second, width), self.group)
        yield MORE
        returned = hop2.result().reshape(-1, width)
        back = output[:first_rows] + torch.cat([returned, zero_row]).index_select(0, to_hop2)
        hop1 = launch(back.view(num_ranks, cap.first, width), self.group)
        yield LAST
        combined = hop1.result().reshape(-1, width)
        return torch.cat([combined, zero_row]).index_select(0, hop1_index)


class PaddedTransport(SlotTransport):
    """Send `[R, s·k]` per pair; the receiver gathers its rows into `[C_dest]` by source offsets."""

    name = "padded"

    def dispatch_phases(self, slot_latent, weights_flat, dest, local_id, pairs, capacity: int, top_k: int):
        num_ranks, me, width = self.group.size, self.group.rank, slot_latent.shape[-1]
        slots, device = slot_latent.shape[0], slot_latent.device
        with torch.no_grad():
            room = destination_room(pairs, capacity)  # [R, R]: rows each pair carries
            buffer_index, keep = pack_slots(dest, weights_flat, num_ranks, room[me])  # [R, s·k] layout
            into_me = room[:, me]  # rows from each source, placed one source after another
            source_start = into_me.cumsum(0) - into_me
        ids = torch.full((num_ranks * slots + 1,), -1, dtype=torch.int32, device=device)
        send = slot_latent.new_zeros(num_ranks * slots + 1, width).index_copy(0, buffer_index, slot_latent)
        send_ids = ids.index_copy(0, buffer_index, local_id.to(torch.int32))
        hop = launch(send[:-1].view(num_ranks, slots, width), self.group)
        hop_ids = launch(send_ids[:-1].view(num_ranks, slots), self.group)
        yield LAST
        received, received_ids = hop.result().reshape(-1, width), hop_ids.result().reshape(-1)
        with torch.no_grad():
            row = torch.arange(capacity, device=device)
            source = torch.searchsorted(source_start + into_me, row, right=True)
            inside = source < num_ranks
            source = source.clamp(max=num_ranks - 1)
            gather = torch.where(inside, source * slots + row - source_start[source], num_ranks * slots)
            pair_row = torch.arange(slots, device=device)
            scatter = torch.where(
                pair_row[None, :] < into_me[:, None], source_start[:, None] + pair_row[None, :], capacity
            ).reshape(-1)  # [R·s·k] -> received row (or trash)
        rows = torch.cat([received, received.new_zeros(1, width)]).index_select(0, gather)
        row_ids = torch.cat([received_ids, received_ids.new_full((1,), -1)]).index_select(0, gather).long()
        sent = wire_bytes(num_ranks * slots, num_ranks * slots, width, slot_latent.element_size())
        return Delivery(rows, row_ids, keep, sent, (scatter, buffer_index, slots))

    def combine_phases(self, output: torch.Tensor, delivery: Delivery):
        scatter, buffer_index, slots = delivery.saved
        num_ranks, width = self.group.size, output.shape[-1]
        back = torch.cat([output, output.new_zeros(1, width)]).index_select(0, scatter)
        hop = launch(back.view(num_ranks, slots, width), self.group)
        yield LAST
        returned = hop.result().reshape(-1, width)
        return torch.cat([returned, returned.new_zeros(1, width)]).index_select(0, buffer_index)


def _packed_by_destination(dest, weights_flat, pairs, capacity: int, me: int):
    """Each destination's kept slots packed one destination after another (highest routing weight
    first within a pair): `(rows to each destination [R], rows from each source [R], each slot's
    packed row or the trash row `s·k` [S], keep [S])` under `destination_room(pairs, capacity)`."""
    num_ranks, slots = pairs.shape[0], dest.shape[0]
    room = destination_room(pairs, capacity)
    buffer_index, keep = pack_slots(dest, weights_flat, num_ranks, room[me])
    first = room[me].cumsum(0) - room[me]
    packed = torch.where(keep, first[dest] + buffer_index - dest * slots, slots)
    return room[me], room[:, me], packed, keep


def _pack_rows(slot_latent, local_id, packed):
    """The slots' rows and local ids at their packed rows `[s·k]` (the trash row cut off)."""
    slots, width = slot_latent.shape
    ids = torch.full((slots + 1,), -1, dtype=torch.int32, device=slot_latent.device)
    send = slot_latent.new_zeros(slots + 1, width).index_copy(0, packed, slot_latent)[:slots]
    return send, ids.index_copy(0, packed, local_id.to(torch.int32))[:slots]


class SplitsTransport(SlotTransport):
    """Exactly the rows that exist, received into exactly the rows that arrive (its only capacity
    is the `R·s·k` slots that exist: it never drops); split sizes read on the host (a device
    synchronisation per dispatch on CUDA, none on gloo)."""

    name = "splits"

    def dispatch_phases(self, slot_latent, weights_flat, dest, local_id, pairs, capacity: int, top_k: int):
        num_ranks, me, width = self.group.size, self.group.rank, slot_latent.shape[-1]
        slots = slot_latent.shape[0]
        with torch.no_grad():
            to_each, from_each, packed, keep = _packed_by_destination(dest, weights_flat, pairs, num_ranks * slots, me)
            sent, taken = to_each.tolist(), from_each.tolist()
        send, send_ids = _pack_rows(slot_latent, local_id, packed)
        hop = launch(send[: sum(sent)], self.group, sent, taken)
        hop_ids = launch(send_ids[: sum(sent)], self.group, sent, taken)
        yield LAST
        received, received_ids = hop.result(), hop_ids.result()
        sent_bytes = wire_bytes(to_each.sum(), from_each.sum(), width, slot_latent.element_size())
        return Delivery(received, received_ids.long(), keep, sent_bytes, (sent, taken, packed, slots))

    def combine_phases(self, output: torch.Tensor, delivery: Delivery):
        sent, taken, packed, slots = delivery.saved
        hop = launch(output[: delivery.rows.shape[0]], self.group, taken, sent)
        yield LAST
        returned = hop.result()
        returned = torch.cat([returned, returned.new_zeros(slots + 1 - returned.shape[0], output.shape[-1])])
        return returned.index_select(0, packed)


class ExactTransport(SlotTransport):
    """Exactly the rows that exist on the wire (at most `s·k` per rank and direction), received
    into a fixed `[C_dest]` buffer, the split sizes kept as tensors (`parallel/device_splits.py`:
    NVSHMEM's device-split all-to-all on CUDA, read on the host on gloo). Static shapes; a slot is
    dropped only past its destination's `C_dest`, which the replica planner keeps it under."""

    name = "exact"

    def __init__(self, group: Group, capacity_factor: float, gpus_per_node: int = 0):
        super().__init__(group, capacity_factor, gpus_per_node)
        self.exchange = counted_all_to_all(group)

    def dispatch_phases(self, slot_latent, weights_flat, dest, local_id, pairs, capacity: int, top_k: int):
        width, slots = slot_latent.shape[-1], slot_latent.shape[0]
        with torch.no_grad():
            to_each, from_each, packed, keep = _packed_by_destination(
                dest, weights_flat, pairs, capacity, self.group.rank
            )
            arrived = torch.arange(capacity, device=slot_latent.device) < from_each.sum()
        send, send_ids = _pack_rows(slot_latent, local_id, packed)
        hop = launch_counted(send, self.exchange, to_each, from_each, capacity)
        hop_ids = launch_counted(send_ids, self.exchange, to_each, from_each, capacity)
        yield LAST
        rows, row_ids = hop.result(), torch.where(arrived, hop_ids.result(), -1).long()
        sent_bytes = wire_bytes(to_each.sum(), from_each.sum(), width, slot_latent.element_size())
        return Delivery(rows, row_ids, keep, sent_bytes, (to_each, from_each, packed, slots))

    def combine_phases(self, output: torch.Tensor, delivery: Delivery):
        to_each, from_each, packed, slots = delivery.saved
        hop = launch_counted(output, self.exchange, from_each, to_each, slots)
        yield LAST
        returned = hop.result()
        return torch.cat([returned, returned.new_zeros(1, output.shape[-1])]).index_select(0, packed)


class NodeTransport(TokenTransport):
    """Rows cross between nodes once per (token, node) and are forwarded inside the node;
    combine reduces at the node's gateway (`parallel/expert_nodes.py`). Fixed buffers, split sizes
    as tensors (the `exact` transport's counted exchange); a slot is dropped only past its
    destination's `C_dest` or its gateway's forwarding capacity (`node_rooms`)."""

    name = "nodes"

    def __init__(self, group: Group, capacity_factor: float, gpus_per_node: int = 0):
        super().__init__(group, capacity_factor, gpus_per_node)
        self.layout = NodeLayout(group, max(1, gpus_per_node))
        self.exchange = counted_all_to_all(group)

    def dispatch_phases(self, slot_latent, weights_flat, dest, local_id, pairs, capacity: int, top_k: int):
        width = slot_latent.shape[-1]
        token_latent = slot_latent.view(-1, top_k, width)[:, 0]
        with torch.no_grad():
            room, grant = node_rooms(pairs, self.layout, capacity)
            me = self.group.rank
            keep = node_keep(dest, weights_flat, room[me], grant[me], self.layout, self.group.size)
        rows, ids, saved = yield from node_dispatch(
            self.group,
            self.layout,
            self.exchange,
            token_latent,
            dest.view(-1, top_k),
            local_id.view(-1, top_k),
            weights_flat.view(-1, top_k),
            keep.view(-1, top_k),
            capacity,
        )
        send_a, receive_a, send_b, receive_b = saved[0]
        sent_rows = send_a.sum() + send_b.sum()
        returned_rows = receive_a.sum() + receive_b.sum()
        sent = wire_bytes(sent_rows, returned_rows, width, slot_latent.element_size())
        return Delivery(rows, ids.long(), keep, sent, saved)

    def combine_weighted_phases(self, output, delivery: Delivery, weights_flat, top_k: int):
        return (yield from node_combine(self.group, self.exchange, output, delivery.saved))


TRANSPORT_CLASSES: dict[str, type[TokenTransport]] = {
    cls.name: cls
    for cls in (SpreadTransport, RelayTransport, PaddedTransport, SplitsTransport, ExactTransport, NodeTransport)
}
