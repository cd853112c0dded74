"""`capacity` expert dispatch (`parallel.expert_dispatch: capacity`): every slot goes to its
expert's home rank through per-pair buffers of `C_pair` slots, and what overflows a pair is
dropped (lowest routing weight first) and counted. No replicas; `ExpertParallel` calls it in place
of its balanced dispatch. Layout and drop policy: docs/expert_parallel.md."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from k3train.parallel.expert import DispatchInfo
from k3train.parallel.expert_plan import capacity_per_pair, home_route, pack_slots
from k3train.parallel.expert_replicas import all_to_all
from k3train.parallel.expert_transports import wire_bytes

if TYPE_CHECKING:
    from k3train.parallel.expert import ExpertParallel, SupportsGroupedForward


def capacity_dispatch(
    ep: ExpertParallel,
    slot_latent: torch.Tensor,
    expert_flat: torch.Tensor,
    weights_flat: torch.Tensor,
    experts: SupportsGroupedForward,
) -> tuple[torch.Tensor, DispatchInfo]:
    """Per-slot expert outputs `[s·k, l]` (zero where dropped) and what the dispatch did: sources
    pack `[R, C_pair]` rows and local ids per destination, one all-to-all each way."""
    num_ranks, width = ep.size, slot_latent.shape[-1]
    slots = expert_flat.shape[0]
    capacity = capacity_per_pair(slots, 1, num_ranks, ep.capacity_factor)
    dest, local_id = home_route(expert_flat, ep.num_local_experts)
    buffer_index, keep = pack_slots(dest, weights_flat, num_ranks, capacity)
    send = slot_latent.new_zeros(num_ranks * capacity + 1, width).index_copy(0, buffer_index, slot_latent)
    send_ids = torch.full((num_ranks * capacity + 1,), -1, dtype=torch.int32, device=slot_latent.device)
    send_ids = send_ids.index_copy(0, buffer_index, local_id.to(torch.int32))
    received = all_to_all(send[:-1].view(num_ranks, capacity, width), ep.group)
    received_ids = ep.group.all_to_all(send_ids[:-1].view(num_ranks, capacity)).long()
    output = experts.grouped_forward(received.view(-1, width), received_ids.view(-1), compute=ep.compute)
    returned = all_to_all(output.view(num_ranks, capacity, width), ep.group).reshape(-1, width)
    slot_output = torch.cat([returned, returned.new_zeros(1, width)]).index_select(0, buffer_index)
    zero = torch.zeros((), dtype=torch.int64, device=slot_latent.device)
    rows = num_ranks * capacity
    info = DispatchInfo(
        keep,
        dest,
        (~keep).sum(),
        (received_ids >= 0).sum(),
        zero,
        None,
        capacity,
        wire_bytes(rows, rows, width, slot_latent.element_size()),
        zero,
    )
    return slot_output, info


__all__ = ["capacity_dispatch"]
