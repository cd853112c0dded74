"""The `nodes` transport: a token's latent row crosses between nodes at most once per destination
node, and is forwarded to that node's expert ranks inside the node (as DeepEP does over NVLink).

Nodes: EP member `j` is on node `global_rank(j) // gpus_per_node`. Each rank has one gateway on
every other node, the member there with its own local index (rail-aligned). Dispatch:

1. inter-node: for every (token, remote node) its kept slots go to, the row once, to that node's
   gateway, with the token's `k` (destination, local expert id, routing weight) entries (−1 for
   choices elsewhere); rows for this rank's own node skip this hop;
2. intra-node: each gateway forwards every (row, choice) to the choice's rank in its node.

Combine runs it back and reduces on the way: the experts' outputs return to the gateway, which
adds them weighted by their routing weights (one row per (token, node)), and that row crosses
back once; the source sums its nodes' rows. The routing weights travel with autograd, so their
gradients come back too.

Static shapes, split sizes as tensors: every hop is a counted all-to-all
(`expert_exchange.launch_counted`, `parallel/device_splits.py`: NVSHMEM's device-split
all-to-all on CUDA, the counts read on the host on gloo) between buffers of fixed rows, each hop's
counts exchanged first in a fixed-shape all-to-all. The bounds every rank derives from the
all-gathered counts (`node_rooms`): a destination receives at most `capacity` slots
(`destination_room`), and a gateway forwards at most `capacity` (the sources' slots for its node,
granted source after source): a source keeps, per node, its slots of highest routing weight within
its grant. Past either bound a slot is dropped and counted, as the other transports do.
`inter-node` rows are counted under `ep.internode`, intra-node forwards under `ep.intranode`.
"""

from __future__ import annotations

import torch

from k3train.parallel.comm import Group
from k3train.parallel.expert_exchange import LAST, MORE, CountedAllToAll, Phases, launch, launch_counted
from k3train.parallel.expert_plan import destination_room, pack_slots, pair_positions


class NodeLayout:
    """Which node each EP member is on, every member's gateway on every node, and the most
    sources that can reach one gateway."""

    def __init__(self, group: Group, gpus_per_node: int):
        if gpus_per_node < 1:
            raise ValueError(f"parallel.gpus_per_node must be at least 1, got {gpus_per_node}")
        raw = [rank // gpus_per_node for rank in group.ranks]
        names = sorted(set(raw))
        self.node = [names.index(n) for n in raw]  # node of each EP member, 0 … nodes − 1
        self.num_nodes = len(names)
        members = [[j for j in range(group.size) if self.node[j] == n] for n in range(self.num_nodes)]
        local = [members[self.node[j]].index(j) for j in range(group.size)]
        # gateways[j][n]: member j's gateway on node n (itself on its own node)
        self.gateways = [[m[local[j] % len(m)] for m in members] for j in range(group.size)]
        self.gateway = self.gateways[group.rank]
        self.my_node = self.node[group.rank]
        # the remote sources whose gateway on this node is this rank: what hop 1 can bring it
        self.remote_sources = sum(
            1
            for j in range(group.size)
            if self.node[j] != self.my_node and self.gateways[j][self.my_node] == group.rank
        )


def node_rooms(pairs: torch.Tensor, layout: NodeLayout, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(room [R, R], grant [R, N])` from the pair counts: the slots each (source, destination)
    pair may send under `capacity` per destination (`destination_room`), and of those, the slots
    each source may send to each node under `capacity` forwards per gateway (granted source after
    source at each gateway). The same on every rank."""
    device = pairs.device
    room = destination_room(pairs, capacity)
    node_of_rank = torch.tensor(layout.node, dtype=torch.int64, device=device)
    to_node = torch.zeros(pairs.shape[0], layout.num_nodes, dtype=torch.int64, device=device)
    to_node = to_node.index_add(1, node_of_rank, room)  # [R, N] slots of each source for each node
    gateway = torch.tensor(layout.gateways, dtype=torch.int64, device=device)  # [R, N]
    ranks = torch.arange(pairs.shape[0], device=device)
    earlier = (ranks[:, None] > ranks[None, :])[:, :, None] & (gateway[:, None, :] == gateway[None, :, :])
    before = (earlier * to_node[None, :, :]).sum(1)  # [R, N]: the same gateway's earlier sources
    return room, torch.minimum(to_node, (capacity - before).clamp(min=0))


def node_keep(dest, weights, room_row, grant_row, layout: NodeLayout, num_ranks: int) -> torch.Tensor:
    """This source's kept slots `[S]`: within its destination room, then within its node grant
    (highest routing weight first in both)."""
    _, keep = pack_slots(dest, weights, num_ranks, room_row)
    node_of_rank = torch.tensor(layout.node, dtype=torch.int64, device=dest.device)
    slot_node = torch.where(keep, node_of_rank[dest], layout.num_nodes)
    position = pair_positions(slot_node, weights, layout.num_nodes + 1)
    grant = torch.cat([grant_row, grant_row.new_zeros(1)])
    return keep & (position < grant[slot_node])


def node_dispatch(
    group: Group,
    layout: NodeLayout,
    exchange: CountedAllToAll,
    token_latent: torch.Tensor,
    dest: torch.Tensor,
    local_id: torch.Tensor,
    weights: torch.Tensor,
    keep: torch.Tensor,
    capacity: int,
) -> Phases[tuple[torch.Tensor, torch.Tensor, tuple]]:
    """`token_latent [s, l]`, `dest`, `local_id`, `weights`, `keep` `[s, k]` → (the `[capacity]`
    rows this rank's experts receive, their local ids (−1 past what arrived), what `node_combine`
    needs); a phase generator (`parallel/expert_exchange.py`)."""
    tokens, top_k = dest.shape
    device, size, nodes = dest.device, group.size, layout.num_nodes
    node_of_rank = torch.tensor(layout.node, dtype=torch.int64, device=device)
    gateway_of_node = torch.tensor(layout.gateway, dtype=torch.int64, device=device)
    with torch.no_grad():
        slot_node = torch.where(keep, node_of_rank[dest], nodes)  # [s, k], `nodes`: not sent
        hit = torch.zeros(tokens, nodes + 1, dtype=torch.bool, device=device).scatter_(1, slot_node, True)[:, :nodes]
        token = torch.arange(tokens, device=device)[:, None].expand(tokens, nodes).reshape(-1)
        node = torch.arange(nodes, device=device)[None, :].expand(tokens, nodes).reshape(-1)
        hit = hit.reshape(-1)
        remote = hit & (node != layout.my_node)
        local = hit & (node == layout.my_node)
        # packed (token, node) entries: remote ones by gateway, then this node's, then the rest
        key = torch.where(remote, gateway_of_node[node], torch.where(local, size, size + 1)) * tokens + token
        order = torch.sort(key, stable=True).indices
        token, node, remote = token[order], node[order], remote[order]
        choice_here = slot_node[token] == node[:, None]  # [s·N, k]
        meta = torch.cat(
            [torch.where(choice_here, dest[token], -1), torch.where(choice_here, local_id[token], -1)], dim=1
        )
        send_a = torch.zeros(size, dtype=torch.int64, device=device).scatter_add_(
            0, gateway_of_node[node], remote.long()
        )
        remote_total, local_count = send_a.sum(), local.sum()
        counts_a = launch(send_a, group)
    yield MORE
    receive_a = counts_a.result()
    rows = token_latent.index_select(0, token)  # [s·N, l]
    packed_weights = torch.where(choice_here, weights[token], 0.0)  # [s·N, k], with autograd
    arrive_rows = layout.remote_sources * tokens
    label = f"{group.name}.internode"
    hop_rows = launch_counted(rows, exchange, send_a, receive_a, arrive_rows, label)
    hop_meta = launch_counted(meta, exchange, send_a, receive_a, arrive_rows, label)
    hop_weights = launch_counted(packed_weights, exchange, send_a, receive_a, arrive_rows, label)
    with torch.no_grad():  # this node's own rows follow the remote ones in the packed order
        local_index = (remote_total + torch.arange(tokens, device=device)).clamp(max=tokens * nodes - 1)
        local_valid = torch.arange(tokens, device=device) < local_count
    yield MORE
    arrived_valid = torch.arange(arrive_rows, device=device) < receive_a.sum()
    held = torch.cat([rows.index_select(0, local_index), hop_rows.result()])  # [s + A, l]
    held_meta = torch.where(
        torch.cat([local_valid, arrived_valid])[:, None],
        torch.cat([meta.index_select(0, local_index), hop_meta.result()]),
        -1,
    )
    held_weights = torch.cat([packed_weights.index_select(0, local_index), hop_weights.result()])
    with torch.no_grad():
        targets = held_meta[:, :top_k].reshape(-1)  # [H·k]: each (row, choice)'s rank, −1 none
        valid = targets >= 0
        by_target = torch.sort(torch.where(valid, targets, size), stable=True).indices[:capacity]
        pair_valid = valid[by_target]  # the gateway's grant keeps every valid pair within `capacity`
        pair_row = torch.div(by_target, top_k, rounding_mode="floor")
        pair_choice = by_target % top_k
        send_b = torch.zeros(size, dtype=torch.int64, device=device).scatter_add_(
            0, targets[by_target].clamp(min=0), pair_valid.long()
        )
        pair_ids = torch.where(pair_valid, held_meta[:, top_k:].reshape(-1)[by_target], -1)
        counts_b = launch(send_b, group)
    yield MORE
    receive_b = counts_b.result()
    intra = f"{group.name}.intranode"
    hop_rows_b = launch_counted(held.index_select(0, pair_row), exchange, send_b, receive_b, capacity, intra)
    hop_ids = launch_counted(pair_ids, exchange, send_b, receive_b, capacity, intra)
    yield LAST
    arrived = torch.arange(capacity, device=device) < receive_b.sum()
    received, received_ids = hop_rows_b.result(), torch.where(arrived, hop_ids.result(), -1)
    saved = (
        (send_a, receive_a, send_b, receive_b),
        (token, local_index, local_valid, tokens),
        (pair_row, pair_choice, pair_valid, held_weights, held.shape[0]),
    )
    return received, received_ids, saved


def node_combine(group: Group, exchange: CountedAllToAll, output: torch.Tensor, saved: tuple) -> Phases[torch.Tensor]:
    """The experts' outputs `[capacity, l]` (rows as `node_dispatch` delivered them) → `Σ_k p·E`
    per token `[s, l]`, reduced at each node's gateway before crossing back (a phase generator)."""
    (send_a, receive_a, send_b, receive_b), (token, local_index, local_valid, tokens), pairs = saved
    pair_row, pair_choice, pair_valid, held_weights, held_rows = pairs
    width = output.shape[-1]
    wide = torch.promote_types(output.dtype, torch.float32)
    hop_back = launch_counted(output, exchange, receive_b, send_b, pair_row.shape[0], f"{group.name}.intranode")
    yield MORE
    back = hop_back.result()  # pair order, zeros past the valid pairs
    pair_weight = torch.where(pair_valid, held_weights[pair_row, pair_choice], 0.0)
    weighted = back.to(wide) * pair_weight.to(wide)[:, None]
    per_row = weighted.new_zeros(held_rows, width).index_add(0, pair_row, weighted)  # one row per (token, node)
    packed_rows = token.shape[0]
    hop_home = launch_counted(per_row[tokens:], exchange, receive_a, send_a, packed_rows, f"{group.name}.internode")
    yield LAST
    returned = hop_home.result()  # the remote (token, node) rows in the packed order, zeros after
    mine = returned.index_add(0, local_index, torch.where(local_valid[:, None], per_row[:tokens], 0.0))
    return mine.new_zeros(tokens, width).index_add(0, token, mine)
