"""Thin wrappers over torch.distributed collectives that count their traffic per group.

Every collective k3train issues goes through a `Group`, which forwards to torch.distributed
and adds the bytes this rank sends and one message to its `TrafficCounter`. Tests and benchmarks
read the counters to check communication volume against the formulas. Byte counts are what this
rank contributes: an all-reduce of N bytes counts N, an all-gather of a local shard of N bytes
counts N, a reduce-scatter of a full N-byte input counts N, an all-to-all counts its input.

The counter also remembers the last collective this rank launched (group and operation): when a
peer dies or stops answering, torch's error names neither, and `describe_collective_failure`
turns it into one line that does.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class TrafficCounter:
    """Bytes and messages per group name, for this rank."""

    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    messages: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    last_launched: tuple[str, str] | None = None
    """(group name, operation) of the last collective this rank launched (a failure report names it)."""

    def add(self, group_name: str, tensor: torch.Tensor, operation: str = "all_reduce") -> None:
        self.bytes[group_name] += tensor.numel() * tensor.element_size()
        self.messages[group_name] += 1
        self.last_launched = (group_name, operation)

    def note(self, group_name: str, operation: str) -> None:
        """Record a launch that sends nothing counted (a receive)."""
        self.last_launched = (group_name, operation)

    def reset(self) -> None:
        self.bytes.clear()
        self.messages.clear()

    def snapshot(self) -> dict[str, tuple[int, int]]:
        return {name: (self.bytes[name], self.messages[name]) for name in sorted(self.bytes)}


@dataclass
class Group:
    """One process group: its ranks, this rank's place in it, and counted collectives.

    A group of size 1 needs no process group: every collective is the identity (no traffic).
    """

    name: str
    ranks: tuple[int, ...]
    rank: int  # this process's index within `ranks`
    process_group: dist.ProcessGroup | None
    counter: TrafficCounter

    @property
    def size(self) -> int:
        return len(self.ranks)

    def global_rank(self, index: int) -> int:
        return self.ranks[index]

    # ------------------------------------------------------------------ collectives
    def all_reduce(
        self, tensor: torch.Tensor, op: dist.ReduceOp | dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
    ) -> torch.Tensor:
        if self.size > 1:
            self.counter.add(self.name, tensor)
            dist.all_reduce(tensor, op=op, group=self.process_group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Concatenate every rank's `tensor` along `dim` (rank order)."""
        if self.size == 1:
            return tensor
        self.counter.add(self.name, tensor, "all_gather")
        tensor = tensor.contiguous()
        if dim == 0:
            output = tensor.new_empty((self.size * tensor.shape[0], *tensor.shape[1:]))
            dist.all_gather_single(output, tensor, group=self.process_group)
            return output
        pieces = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(pieces, tensor, group=self.process_group)
        return torch.cat(pieces, dim=dim)

    def reduce_scatter(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Sum over ranks, then keep this rank's equal slice along `dim`."""
        if self.size == 1:
            return tensor
        if tensor.shape[dim] % self.size:
            raise ValueError(f"{self.name}: dimension {dim} of {tuple(tensor.shape)} does not split into {self.size}")
        self.counter.add(self.name, tensor, "reduce_scatter")
        if dim != 0:
            tensor = tensor.movedim(dim, 0)
        output = tensor.new_empty((tensor.shape[0] // self.size, *tensor.shape[1:]))
        dist.reduce_scatter_single(output, tensor.contiguous(), group=self.process_group)
        return output.movedim(0, dim).contiguous() if dim != 0 else output

    def broadcast(self, tensor: torch.Tensor, source_index: int) -> torch.Tensor:
        if self.size > 1:
            if self.rank == source_index:
                self.counter.add(self.name, tensor, "broadcast")
            else:
                self.counter.note(self.name, "broadcast")
            dist.broadcast(tensor, src=self.ranks[source_index], group=self.process_group)
        return tensor

    def all_to_all(self, tensor: torch.Tensor) -> torch.Tensor:
        """Equal splits along dim 0: slice i goes to rank i, slice j of the output came from rank j."""
        if self.size == 1:
            return tensor
        self.counter.add(self.name, tensor, "all_to_all")
        output = torch.empty_like(tensor)
        dist.all_to_all_single(output, tensor.contiguous(), group=self.process_group)
        return output

    def all_to_all_uneven(
        self, tensor: torch.Tensor, send: list[int], receive: list[int], label: str | None = None
    ) -> torch.Tensor:
        """Along dim 0 with host split sizes: `send[j]` rows go to rank j, `receive[j]` come from it.
        Counted under `label` (default: the group's name)."""
        if self.size == 1:
            return tensor
        self.counter.add(label or self.name, tensor)
        output = tensor.new_empty(sum(receive), *tensor.shape[1:])
        dist.all_to_all_single(output, tensor.contiguous(), receive, send, group=self.process_group)
        return output

    def send(self, tensor: torch.Tensor, destination_index: int) -> None:
        self.counter.add(self.name, tensor, "send")
        dist.send(tensor.contiguous(), dst=self.ranks[destination_index], group=self.process_group)

    def recv(self, tensor: torch.Tensor, source_index: int) -> torch.Tensor:
        self.counter.note(self.name, "recv")
        dist.recv(tensor, src=self.ranks[source_index], group=self.process_group)
        return tensor

    def isend(self, tensor: torch.Tensor, destination_index: int, tag: int = 0, label: str | None = None) -> dist.Work:
        """Non-blocking send of a contiguous `tensor` (unchanged until the work completes),
        counted under `label` (default: the group's name, e.g. `pp.forward` for pipeline hops)."""
        self.counter.add(label or self.name, tensor, "isend")
        work = dist.isend(tensor, dst=self.ranks[destination_index], group=self.process_group, tag=tag)
        assert work is not None, "torch returns no work only to a rank outside the group"
        return work

    def irecv(self, tensor: torch.Tensor, source_index: int, tag: int = 0) -> dist.Work:
        """Non-blocking receive into `tensor` (matched by source and tag on gloo)."""
        self.counter.note(self.name, "irecv")
        work = dist.irecv(tensor, src=self.ranks[source_index], group=self.process_group, tag=tag)
        assert work is not None, "torch returns no work only to a rank outside the group"
        return work

    def barrier(self) -> None:
        if self.size > 1:
            self.counter.note(self.name, "barrier")
            dist.barrier(group=self.process_group)


# What gloo and NCCL say when a peer stops answering or goes away (they name no group).
_TIMEOUT_MARKERS = ("timed out", "timeout", "watchdog caught collective")
_PEER_LOST_MARKERS = (
    "connection closed by peer",
    "connection reset",
    "broken pipe",
    "connection refused",
    "socket closed",
    "remote process exited",
)


def describe_collective_failure(
    error: BaseException, counter: TrafficCounter | None, timeout_s: float | None
) -> str | None:
    """One line for a collective that failed because a peer died or stopped answering, naming
    the group and operation this rank launched last; None when `error` is not such a failure."""
    text = " ".join(str(error).split()).lower()
    distributed_error = isinstance(error, getattr(dist, "DistError", ())) or any(
        marker in text for marker in ("gloo", "nccl", "c10d", "process group", "caused pair closure")
    )  # gloo's async work.wait() timeout
    if not distributed_error:
        return None
    group, operation = counter.last_launched if counter and counter.last_launched else ("?", "collective")
    where = f"collective {operation} on group '{group}'" if group != "?" else "a collective"
    if any(marker in text for marker in _TIMEOUT_MARKERS):
        bound = f" after {timeout_s:g}s" if timeout_s else ""
        return (
            f"{where} timed out{bound} (a rank stopped answering?); raise parallel.collective_timeout_s "
            f"if a rank legitimately needs longer"
        )
    if any(marker in text for marker in _PEER_LOST_MARKERS):
        return f"{where} failed: a peer rank closed its connection (it died?)"
    return f"{where} failed: {str(error).strip().splitlines()[0][:300]}"
