"""How `balanced` expert parallelism moves token rows: one interface, four transports.

A transport routes a source's slots to their holders under the micro-batch's replica plan
(`route`), sends them (`dispatch`: the rows and local expert ids this rank's experts receive,
and what its `combine` needs) and brings the expert outputs back into the source's slots
(`combine`). The dispatcher (`parallel/expert.py`) plans, fetches replicas and runs the experts
between the two; it knows nothing of the layouts. Layouts and bounds: docs/expert_parallel.md.

* `spread` (the GPU default): two fixed-shape hops that deliver every slot while every
  destination is within its capacity (`parallel/expert_spread.py`).
* `relay`: two fixed-shape hops within `capacity_factor` of the unpadded rows; a pair's overflow
  through other ranks' spare rows; drops (counted) past its bound.
* `padded`: one all-to-all of `s·k` rows per pair, received into `[C_dest]` (a reference).
* `splits` (the gloo default): exactly the rows that exist, split sizes read on the host.

Another transport (a device-split or one-sided kernel, or one that crosses between nodes once
per node) implements the same three methods.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

import torch

from k3train.parallel.comm import Group
from k3train.parallel.expert_nodes import NodeLayout, node_combine, node_dispatch
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
from k3train.parallel.expert_replicas import all_to_all
from k3train.parallel.expert_spread import plan_spread, spread_capacity, spread_forward, spread_kept, spread_route


def all_to_all_splits(
    group: Group, x: torch.Tensor, send: list[int], receive: list[int], label: str | None = None
) -> torch.Tensor:
    """All-to-all along dim 0 with host split sizes: `send[j]` rows to rank j, `receive[j]` from it."""
    return group.all_to_all_uneven(x, send, receive, label)


class _AllToAllSplits(torch.autograd.Function):
    """`all_to_all_splits` whose backward sends the gradients back the way the rows came."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, send: list[int], receive: list[int]) -> torch.Tensor:
        ctx.group, ctx.send, ctx.receive = group, send, receive
        return all_to_all_splits(group, x, send, receive)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_to_all_splits(ctx.group, grad, ctx.receive, ctx.send), None, None, None


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
    replicated expert's slots)."""

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

    @abc.abstractmethod
    def dispatch(self, slot_latent, weights_flat, dest, local_id, pairs, capacity: int, top_k: int) -> Delivery:
        """This source's slots to their experts' ranks: what this rank received."""

    @abc.abstractmethod
    def combine_weighted(self, output, delivery: Delivery, weights_flat, top_k: int) -> torch.Tensor:
        """`Σ_k p_k · E_k` per token `[s, l]`; a transport may reduce before the rows travel back."""


class SlotTransport(TokenTransport):
    """A transport that returns every slot's output to its source, where the weighted sum is made."""

    @abc.abstractmethod
    def combine(self, output: torch.Tensor, delivery: Delivery) -> torch.Tensor:
        """The outputs back into the source's slots `[s·k, l]`."""

    def combine_weighted(self, output, delivery: Delivery, weights_flat, top_k: int) -> torch.Tensor:
        return weighted_sum(self.combine(output, delivery), weights_flat, top_k)


class SpreadTransport(SlotTransport):
    """Hop 1 `[R, C1]` spreads each source's slots evenly over all ranks, hop 2 `[R, C2]`
    forwards them to their destinations; combine runs both backwards."""

    name = "spread"

    def dispatch(self, slot_latent, weights_flat, dest, local_id, pairs, capacity: int, top_k: int) -> Delivery:
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
        received = all_to_all(send.view(num_ranks, cap.first, width), self.group).reshape(-1, width)
        received_ids = self.group.all_to_all(send_ids.view(num_ranks, cap.first)).reshape(-1)
        forward = torch.cat([received, zero_row]).index_select(0, from_hop1)
        forward_ids = torch.cat([received_ids, received_ids.new_full((1,), -1)]).index_select(0, from_hop1)
        rows = all_to_all(forward.view(num_ranks, cap.second, width), self.group).reshape(-1, width)
        row_ids = self.group.all_to_all(forward_ids.view(num_ranks, cap.second)).reshape(-1).long()
        wire_rows = num_ranks * cap.rows
        sent = wire_bytes(wire_rows, wire_rows, width, slot_latent.element_size())
        return Delivery(rows, row_ids, keep, sent, (cap, to_hop2, hop1_index))

    def combine(self, output: torch.Tensor, delivery: Delivery) -> torch.Tensor:
        cap, to_hop2, hop1_index = delivery.saved
        num_ranks, width = self.group.size, output.shape[-1]
        returned = all_to_all(output.view(num_ranks, cap.second, width), self.group).reshape(-1, width)
        back = torch.cat([returned, output.new_zeros(1, width)]).index_select(0, to_hop2)
        combined = all_to_all(back.view(num_ranks, cap.first, width), self.group).reshape(-1, width)
        return combined.index_select(0, hop1_index)


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

    def dispatch(self, slot_latent, weights_flat, dest, local_id, pairs, capacity: int, top_k: int) -> Delivery:
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
        received = all_to_all(send[:-1].view(num_ranks, cap.first, width), self.group).reshape(-1, width)
        received_ids = self.group.all_to_all(send_ids[:-1].view(num_ranks, cap.first)).reshape(-1)
        forward = torch.cat([received, zero_row]).index_select(0, from_hop1)
        forward_ids = torch.cat([received_ids, received_ids.new_full((1,), -1)]).index_select(0, from_hop1)
        relayed = all_to_all(forward.view(num_ranks, cap.second, width), self.group).reshape(-1, width)
        relayed_ids = self.group.all_to_all(forward_ids.view(num_ranks, cap.second)).reshape(-1)
        rows = torch.cat([received, relayed])
        row_ids = torch.cat([torch.where(direct, received_ids, -1), relayed_ids]).long()
        wire_rows = num_ranks * cap.rows
        sent = wire_bytes(wire_rows, wire_rows, width, slot_latent.element_size())
        return Delivery(rows, row_ids, keep, sent, (cap, to_hop2, hop1_index))

    def combine(self, output: torch.Tensor, delivery: Delivery) -> torch.Tensor:
        cap, to_hop2, hop1_index = delivery.saved
        num_ranks, width = self.group.size, output.shape[-1]
        first_rows = num_ranks * cap.first
        zero_row = output.new_zeros(1, width)
        returned = all_to_all(output[first_rows:].view(num_ranks, cap.second, width), self.group).reshape(-1, width)
        back = output[:first_rows] + torch.cat([returned, zero_row]).index_select(0, to_hop2)
        combined = all_to_all(back.view(num_ranks, cap.first, width), self.group).reshape(-1, width)
        return torch.cat([combined, zero_row]).index_select(0, hop1_index)


class PaddedTransport(SlotTransport):
    """Send `[R, s·k]` per pair; the receiver gathers its rows into `[C_dest]` by source offsets."""

    name = "padded"

    def dispatch(self, slot_latent, weights_flat, dest, local_id, pairs, capacity: int, top_k: int) -> Delivery:
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
        received = all_to_all(send[:-1].view(num_ranks, slots, width), self.group).reshape(-1, width)
        received_ids = self.group.all_to_all(send_ids[:-1].view(num_ranks, slots)).reshape(-1)
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

    def combine(self, output: torch.Tensor, delivery: Delivery) -> torch.Tensor:
        scatter, buffer_index, slots = delivery.saved
        num_ranks, width = self.group.size, output.shape[-1]
        back = torch.cat([output, output.new_zeros(1, width)]).index_select(0, scatter)
        returned = all_to_all(back.view(num_ranks, slots, width), self.group).reshape(-1, width)
        return torch.cat([returned, returned.new_zeros(1, width)]).index_select(0, buffer_index)


class SplitsTransport(SlotTransport):
    """Exactly the rows that exist, received into exactly the rows that arrive (its only capacity
    is the `R·s·k` slots that exist: it never drops); split sizes read on the host (a device
    synchronisation per dispatch on CUDA, none on gloo)."""

    name = "splits"

    def dispatch(self, slot_latent, weights_flat, dest, local_id, pairs, capacity: int, top_k: int) -> Delivery:
        num_ranks, me, width = self.group.size, self.group.rank, slot_latent.shape[-1]
        slots, device = slot_latent.shape[0], slot_latent.device
        with torch.no_grad():
            room = destination_room(pairs, num_ranks * slots)
            buffer_index, keep = pack_slots(dest, weights_flat, num_ranks, room[me])
            into_me = room[:, me]
            sent, taken = room[me].tolist(), into_me.tolist()
            first = room[me].cumsum(0) - room[me]
            packed = torch.where(keep, first[dest] + buffer_index - dest * slots, slots)
        ids = torch.full((slots + 1,), -1, dtype=torch.int32, device=device)
        send = slot_latent.new_zeros(slots + 1, width).index_copy(0, packed, slot_latent)[: sum(sent)]
        send_ids = ids.index_copy(0, packed, local_id.to(torch.int32))[: sum(sent)]
        received = _AllToAllSplits.apply(send, self.group, sent, taken)
        received_ids = all_to_all_splits(self.group, send_ids, sent, taken)
        sent_bytes = wire_bytes(room[me].sum(), into_me.sum(), width, slot_latent.element_size())
        return Delivery(received, received_ids.long(), keep, sent_bytes, (sent, taken, packed, slots))

    def combine(self, output: torch.Tensor, delivery: Delivery) -> torch.Tensor:
        sent, taken, packed, slots = delivery.saved
        returned = _AllToAllSplits.apply(output[: delivery.rows.shape[0]], self.group, taken, sent)
        returned = torch.cat([returned, returned.new_zeros(slots + 1 - returned.shape[0], output.shape[-1])])
        return returned.index_select(0, packed)


class NodeTransport(TokenTransport):
    """Rows cross between nodes once per (token, node) and are forwarded inside the node;
    combine reduces at the node's gateway (`parallel/expert_nodes.py`; host splits: the gloo
    reference). Every slot is delivered (no capacity)."""

    name = "nodes"

    def __init__(self, group: Group, capacity_factor: float, gpus_per_node: int = 0):
        super().__init__(group, capacity_factor, gpus_per_node)
        self.layout = NodeLayout(group, max(1, gpus_per_node))

    def dispatch(self, slot_latent, weights_flat, dest, local_id, pairs, capacity: int, top_k: int) -> Delivery:
        width = slot_latent.shape[-1]
        token_latent = slot_latent.view(-1, top_k, width)[:, 0]
        rows, ids, saved = node_dispatch(
            self.group,
            self.layout,
            token_latent,
            dest.view(-1, top_k),
            local_id.view(-1, top_k),
            weights_flat.view(-1, top_k),
        )
        (send_a, receive_a, send_b, receive_b) = saved[0]
        sent_rows = sum(send_a) + sum(send_b)
        returned_rows = sum(receive_a) + sum(receive_b)
        keep = torch.ones_like(dest, dtype=torch.bool)
        sent = wire_bytes(sent_rows, returned_rows, width, slot_latent.element_size())
        return Delivery(rows, ids.long(), keep, sent, saved)

    def combine_weighted(self, output, delivery: Delivery, weights_flat, top_k: int) -> torch.Tensor:
        return node_combine(self.group, output, delivery.saved)


TRANSPORT_CLASSES: dict[str, type[TokenTransport]] = {
    cls.name: cls for cls in (SpreadTransport, RelayTransport, PaddedTransport, SplitsTransport, NodeTransport)
}
