"""Newton–Schulz split across data-parallel ranks without ZeRO-1.

With a replicated optimizer (`parallel.zero1=false`) every DP rank would orthogonalise every Muon
matrix, repeating the optimizer's most expensive work DP times. Here each rank orthogonalises only
the matrices it would own under ZeRO-1 (the owner plan of `DistributedOptimizer.plan`: whole
matrices, balanced by Newton–Schulz cost), and the updates are all-gathered in flat padded buffers
per replica group. Every rank still advances every momentum and applies every update, so the
optimizer state stays replicated (checkpoints are unchanged) and the parameters are the same as
without the split: the owner computes exactly what every rank would compute, and the exchange
carries the update in the parameter's dtype, which is the dtype the update is applied in (a bf16
Newton–Schulz result widens to fp32 exactly).

The optimizer side (`k3train.optim.muon.PerHeadMuon.split`) asks `computes(param)` and calls
`share(params, updates)`; this module knows nothing of Muon beyond that and imports no model.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import nn

from k3train.parallel.grad_reduce import DEFAULT_BUCKET_BYTES, replica_group
from k3train.parallel.state import ParallelState
from k3train.parallel.zero1 import FlatExchange


class MuonSplit:
    """Which rank orthogonalises which Muon parameter, and the all-gather of the updates.

    `muon_params`: the optimizer's Muon parameters by name (model order); `owners`: each one's
    owner index in its replica group (ZeRO-1's plan); `state`: this rank's groups. Parameters
    whose replica group has one rank are always computed here and never exchanged.
    """

    def __init__(
        self,
        muon_params: Mapping[str, nn.Parameter],
        owners: Mapping[str, int],
        state: ParallelState,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        missing = [name for name in muon_params if name not in owners]
        if missing:
            raise ValueError(f"the owner plan has no owner for Muon parameters {missing[:5]}")
        self.bucket_bytes = bucket_bytes
        self._computed_here: set[int] = set()
        exchanges: dict[tuple[str, torch.dtype], FlatExchange] = {}
        for name, param in muon_params.items():
            group, owner = replica_group(param, state), owners[name]
            if group.size == 1 or owner == group.rank:
                self._computed_here.add(id(param))
            if group.size == 1:
                continue
            key = (group.name, param.dtype)
            if key not in exchanges:
                exchanges[key] = FlatExchange(group, param.dtype, param.device, [[] for _ in range(group.size)])
            owned = exchanges[key].per_rank[owner]
            owned.append((param, owned[-1][1] + owned[-1][0].numel() if owned else 0))
        # Sorted by group name and dtype: every rank of a group issues its all-gathers in one order.
        self._exchanges = [exchanges[key] for key in sorted(exchanges, key=lambda k: (k[0], str(k[1])))]

    @property
    def exchanges(self) -> list[FlatExchange]:
        """The per-step all-gathers, one per (replica group, dtype), in issue order (traffic formula)."""
        return list(self._exchanges)

    def computes(self, param: torch.Tensor) -> bool:
        return id(param) in self._computed_here

    def share(self, params: Sequence[torch.Tensor], updates: list[torch.Tensor | None]) -> list[torch.Tensor]:
        """Every rank's updates of `params` (those with a gradient this step: the same set on every
        rank, since gradients are reduced over the replica group); this rank's own in `updates`.
        An owned parameter that is not in `params` sends zeros its peers never read."""
        position = {id(p): i for i, p in enumerate(params)}
        shared = list(updates)
        for exchange in self._exchanges:
            self._all_gather(exchange, position, updates, shared)
        missing = [i for i, update in enumerate(shared) if update is None]
        if missing:
            raise RuntimeError(
                f"no rank orthogonalised {len(missing)} Muon parameters "
                f"(shapes {[tuple(params[i].shape) for i in missing[:3]]})"
            )
        return [update for update in shared if update is not None]  # all of them, as checked

    def _all_gather(
        self,
        exchange: FlatExchange,
        position: dict[int, int],
        updates: list[torch.Tensor | None],
        shared: list[torch.Tensor | None],
    ) -> None:
        """Padded flat buffers in the parameter dtype, all-gathered in chunks of about `bucket_bytes`."""
        group, me = exchange.group, exchange.group.rank
        received: dict[int, torch.Tensor] = {}
        for rank in range(group.size):
            if rank == me:
                continue
            for param, _ in exchange.per_rank[rank]:
                if id(param) in position:
                    received[id(param)] = torch.empty(param.numel(), dtype=exchange.dtype, device=exchange.device)

        def source(param: nn.Parameter) -> torch.Tensor | None:
            index = position.get(id(param))
            update = updates[index] if index is not None else None
            return update.reshape(-1) if update is not None else None

        exchange.all_gather(self.bucket_bytes, source, lambda param: received.get(id(param)))
        for rank in range(group.size):
            for param, _ in exchange.per_rank[rank]:
                if id(param) in received:
                    shared[position[id(param)]] = received[id(param)].view(param.shape)


def install_muon_split(
    optimizer: torch.optim.Optimizer,
    named_params: Iterable[tuple[str, nn.Parameter]],
    owners: Mapping[str, int],
    state: ParallelState,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> MuonSplit | None:
    """Give `optimizer` (a Per-Head Muon: it has a `split` slot and `work_items()`) the split
    over data-parallel ranks, with `owners` from the ZeRO-1 plan; returns it, or None when no
    Muon parameter has a replica group of more than one rank (nothing to split) or the optimizer
    has no Muon (plain AdamW)."""
    if not hasattr(optimizer, "split") or not hasattr(optimizer, "work_items"):
        return None
    names = {id(param): name for name, param in named_params}
    muon = {names[id(item.param)]: item.param for item in optimizer.work_items()}
    if not any(replica_group(param, state).size > 1 for param in muon.values()):
        return None
    split = MuonSplit(muon, owners, state, bucket_bytes)
    optimizer.split = split
    return split


__all__ = ["MuonSplit", "install_muon_split"]
