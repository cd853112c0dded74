"""The `nodes` transport: a token's latent row crosses between nodes at most once per destination
node, and is forwarded to that node's expert ranks inside the node (as DeepEP does over NVLink).

Nodes: EP member `j` is on node `global_rank(j) // gpus_per_node`. Each rank has one gateway on
every other node, the member there with its own local index (rail-aligned). Dispatch:

1. inter-node: for every (token, remote node) its slots go to, the row once, to that node's
   gateway, with the token's `k` (destination, local expert id, routing weight) entries (−1 for
   choices elsewhere); rows for this rank's own node skip this hop;
2. intra-node: each gateway forwards every (row, choice) to the choice's rank in its node.

Combine runs it back and reduces on the way: the experts' outputs return to the gateway, which
adds them weighted by their routing weights (one row per (token, node)), and that row crosses
back once; the source sums its nodes' rows. The routing weights travel with autograd, so their
gradients come back too.

This is the gloo reference: split sizes are exchanged and read on the host (free on CPU). A GPU
version wants device-side splits (NVSHMEM, `torch.distributed._symmetric_memory`); not written.
`inter-node` rows are counted under `ep.internode`, intra-node forwards under `ep.intranode`.
"""

from __future__ import annotations

import torch

from k3train.parallel.comm import Group
from k3train.parallel.expert_exchange import LAST, MORE, Phases, launch


def _counts_to(ranks: torch.Tensor, size: int) -> list[int]:
    return torch.bincount(ranks, minlength=size).tolist()


class NodeLayout:
    """Which node each EP member is on, and this rank's gateway on every node."""

    def __init__(self, group: Group, gpus_per_node: int):
        if gpus_per_node < 1:
            raise ValueError(f"parallel.gpus_per_node must be at least 1, got {gpus_per_node}")
        raw = [rank // gpus_per_node for rank in group.ranks]
        names = sorted(set(raw))
        self.node = [names.index(n) for n in raw]  # node of each EP member, 0 … nodes − 1
        self.num_nodes = len(names)
        members = [[j for j in range(group.size) if self.node[j] == n] for n in range(self.num_nodes)]
        local = members[self.node[group.rank]].index(group.rank)
        self.gateway = [nodes_members[local % len(nodes_members)] for nodes_members in members]
        self.my_node = self.node[group.rank]


def node_dispatch(
    group: Group,
    layout: NodeLayout,
    token_latent: torch.Tensor,
    dest: torch.Tensor,
    local_id: torch.Tensor,
    weights: torch.Tensor,
) -> Phases[tuple[torch.Tensor, torch.Tensor, tuple]]:
    """`token_latent [s, l]`, `dest`, `local_id`, `weights` `[s, k]` → (rows this rank's experts
    receive, their local ids, what `node_combine` needs); a phase generator
    (`parallel/expert_exchange.py`), each exchange's split sizes taken when it is resumed."""
    tokens, top_k = dest.shape
    device, size = dest.device, group.size
    node_of_rank = torch.tensor(layout.node, dtype=torch.int64, device=device)
    gateway_of_node = torch.tensor(layout.gateway, dtype=torch.int64, device=device)
    with torch.no_grad():
        slot_node = node_of_rank[dest]  # [s, k]
        keys = torch.arange(tokens, device=device)[:, None] * layout.num_nodes + slot_node
        unique_keys = torch.unique(keys.reshape(-1))  # sorted (token, node) pairs
        unique_token = torch.div(unique_keys, layout.num_nodes, rounding_mode="floor")
        unique_node = unique_keys % layout.num_nodes
        choice_here = slot_node[unique_token] == unique_node[:, None]  # [u, k]
        meta = torch.cat(
            [torch.where(choice_here, dest[unique_token], -1), torch.where(choice_here, local_id[unique_token], -1)],
            dim=1,
        )  # [u, 2k]: destination rank and local id of each choice on that node
        remote = unique_node != layout.my_node
        gateway = gateway_of_node[unique_node]
        # own node first (kept here), then the remote rows by gateway (the split order)
        order = torch.argsort(torch.where(remote, gateway, -1), stable=True)
        unique_token, choice_here, meta, gateway = unique_token[order], choice_here[order], meta[order], gateway[order]
        local_count = int((~remote).sum())
        send_a = _counts_to(gateway[local_count:], size)
        counts_a = launch(torch.tensor(send_a, dtype=torch.int64, device=device), group)
    yield MORE
    receive_a = counts_a.result().tolist()
    unique_weights = torch.where(choice_here, weights[unique_token], 0.0)  # [u, k], with autograd
    rows = token_latent.index_select(0, unique_token)
    label = f"{group.name}.internode"
    hop_rows = launch(rows[local_count:], group, send_a, receive_a, label)
    hop_meta = launch(meta[local_count:], group, send_a, receive_a, label)
    hop_weights = launch(unique_weights[local_count:], group, send_a, receive_a, label)
    yield MORE
    arrived, arrived_meta, arrived_weights = hop_rows.result(), hop_meta.result(), hop_weights.result()
    held = torch.cat([rows[:local_count], arrived])  # every (token, my node) row this gateway holds
    held_meta = torch.cat([meta[:local_count], arrived_meta])
    held_weights = torch.cat([unique_weights[:local_count], arrived_weights])
    with torch.no_grad():
        targets = held_meta[:, :top_k]  # [h, k]
        pair_row, pair_choice = torch.nonzero(targets >= 0, as_tuple=True)
        pair_dest = targets[pair_row, pair_choice]
        by_dest = torch.argsort(pair_dest, stable=True)
        pair_row, pair_choice, pair_dest = pair_row[by_dest], pair_choice[by_dest], pair_dest[by_dest]
        send_b = _counts_to(pair_dest, size)
        counts_b = launch(torch.tensor(send_b, dtype=torch.int64, device=device), group)
        pair_ids = held_meta[:, top_k:][pair_row, pair_choice]
    yield MORE
    receive_b = counts_b.result().tolist()
    intra = f"{group.name}.intranode"
    hop_rows = launch(held.index_select(0, pair_row), group, send_b, receive_b, intra)
    hop_ids = launch(pair_ids, group, send_b, receive_b, intra)
    yield LAST
    received, received_ids = hop_rows.result(), hop_ids.result()
    saved = (
        (send_a, receive_a, send_b, receive_b),
        (local_count, unique_token, tokens),
        (pair_row, pair_choice, held_weights, held.shape[0]),
    )
    return received, received_ids, saved


def node_combine(group: Group, output: torch.Tensor, saved: tuple) -> Phases[torch.Tensor]:
    """The experts' outputs `[N, l]` (rows as `node_dispatch` delivered them) → `Σ_k p·E`
    per token `[s, l]`, reduced at each node's gateway before crossing back (a phase generator)."""
    (send_a, receive_a, send_b, receive_b), (local_count, unique_token, tokens), pairs = saved
    pair_row, pair_choice, held_weights, held_rows = pairs
    width = output.shape[-1]
    wide = torch.promote_types(output.dtype, torch.float32)
    hop_back = launch(output, group, receive_b, send_b, f"{group.name}.intranode")
    yield MORE
    back = hop_back.result()  # pair order
    weighted = back.to(wide) * held_weights[pair_row, pair_choice].to(wide)[:, None]
    per_row = weighted.new_zeros(held_rows, width).index_add(0, pair_row, weighted)  # one row per (token, node)
    hop_home = launch(per_row[local_count:], group, receive_a, send_a, f"{group.name}.internode")
    yield LAST
    returned = hop_home.result()
    mine = torch.cat([per_row[:local_count], returned])  # in the dispatch's (token, node) order
    return mine.new_zeros(tokens, width).index_add(0, unique_token, mine)
