"""Thin wrappers over torch.distributed collectives that count their traffic per group.

Every collective k3train issues goes through a `Group`, which forwards to torch.distributed
and adds the bytes this rank sends and one message to its `TrafficCounter`. Tests and benchmarks
read the counters to check communication volume against the formulas. Byte counts are what this
rank contributes: an all-reduce of N bytes counts N, an all-gather of a local shard of N bytes
counts N, a reduce-scatter of a full N-byte input counts N, an all-to-all counts its input.

The counter also keeps the seconds this rank waited in each group's collectives (the exposed
communication: a blocking collective's whole call, an asynchronous one's `wait()`), and the last
collective this rank launched (group and operation): when a peer dies or stops answering,
torch's error names neither, and `describe_collective_failure` turns it into one line that does.

A group may carry an `EmulatedLink` (`parallel.emulate_network`, CPU runs): each collective then
completes no earlier than `latency + bytes / bandwidth` after every rank has entered it and the
link is free (transfers queue on it in the order this rank launched them), as on that link, so a gloo run on one machine shows what
overlapping communication with compute hides: an asynchronous collective whose `wait()` comes
after enough compute waits for nothing. The transfer starts when torch's own collective
completes (a blocking call returns; an asynchronous one's future is done): a peer that enters
late delays it, so the wait is the peer's lateness plus the link's time, as on a real network,
not the larger of the two.
Point-to-point messages (`send`, `recv`, `isend`, `irecv`: the pipeline's hops) are timed but
not delayed: a receiver cannot tell when its peer sent without a message of its own. On CUDA the
recorded wait is the host's (NCCL calls return at launch): the exposed time of a GPU run is the
profiler's to measure.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class TrafficCounter:
    """Bytes and messages per group name, for this rank."""

    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    messages: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    wait_seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    """Seconds this rank waited for each label's collectives (blocking calls whole, asynchronous
    ones inside `wait()`): the communication compute did not hide."""
    last_launched: tuple[str, str] | None = None
    """(group name, operation) of the last collective this rank launched (a failure report names it)."""

    def add(self, group_name: str, tensor: torch.Tensor, operation: str = "all_reduce") -> None:
        self.bytes[group_name] += tensor.numel() * tensor.element_size()
        self.messages[group_name] += 1
        self.last_launched = (group_name, operation)

    def note(self, group_name: str, operation: str) -> None:
        """Record a launch that sends nothing counted (a receive)."""
        self.last_launched = (group_name, operation)

    def waited(self, label: str, seconds: float) -> None:
        self.wait_seconds[label] += seconds

    def reset(self) -> None:
        self.bytes.clear()
        self.messages.clear()
        self.wait_seconds.clear()

    def snapshot(self) -> dict[str, tuple[int, int]]:
        return {name: (self.bytes[name], self.messages[name]) for name in sorted(self.bytes)}


@dataclass
class Transfer:
    """One collective on an emulated link: its bytes, when it could start (`entered()`: once every
    rank has launched it, known when torch's collective completes) and, once on the link, when it
    is delivered."""

    nbytes: int
    entered: Callable[[], float]
    delivered_at: float | None = None


@dataclass
class EmulatedLink:
    """A network link for CPU runs, one per group and rank. Transfers share it one after the
    other, in the order this rank launched them: a collective of `nbytes` (what this rank
    sends, as counted) that every rank has entered at `t` starts when the link is free,
    `start = max(t, busy_until)`, and completes at `start + latency_s + nbytes / bandwidth` at the
    earliest (the link is busy until `start + nbytes / bandwidth`). Two pieces launched together
    thus arrive one after the other, as on a wire, and a blocking collective launched behind an
    asynchronous one waits for it."""

    bandwidth_bytes_per_s: float
    latency_s: float
    busy_until: float = 0.0
    queued: list[Transfer] = field(default_factory=list)
    """Transfers launched and not yet placed on the link, in launch order."""

    def seconds(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s

    def schedule(self, launched: float, nbytes: int) -> float:
        """The emulated completion time of a transfer that can start at `launched` (and book the link)."""
        start = max(launched, self.busy_until)
        self.busy_until = start + nbytes / self.bandwidth_bytes_per_s
        return start + self.seconds(nbytes)

    def launch(self, nbytes: int, entered: Callable[[], float]) -> Transfer:
        transfer = Transfer(nbytes, entered)
        self.queued.append(transfer)
        return transfer

    def delivery(self, transfer: Transfer) -> float:
        """When `transfer` is delivered: every transfer launched before it goes on the link first."""
        while transfer.delivered_at is None:
            first = self.queued.pop(0)
            first.delivered_at = self.schedule(first.entered(), first.nbytes)
        return transfer.delivered_at


def hold_until(deadline: float) -> None:
    """Sleep until `deadline` (`time.perf_counter()` seconds), if it is still ahead."""
    remaining = deadline - time.perf_counter()
    if remaining > 0:
        time.sleep(remaining)


class TimedWork:
    """An asynchronous collective's work: `wait()` blocks until it is done (and, with an emulated
    link, until the link would have delivered it) and counts the time spent waiting as exposed."""

    def __init__(self, work: dist.Work, label: str, counter: TrafficCounter, link: EmulatedLink | None, nbytes: int):
        self.work, self.label, self.counter = work, label, counter
        self.link, self.nbytes = link, nbytes
        self.launched = time.perf_counter()
        self.entered_by_all: float | None = None
        """When torch's collective completed (every rank had launched it), from its future."""
        self.watched = False
        if link is not None and hasattr(work, "get_future"):
            try:
                work.get_future().add_done_callback(self._completed)
                self.watched = True
            except RuntimeError:  # gloo's reduce-scatter has no future: judged at `wait()`
                pass
        self.transfer = link.launch(nbytes, self._entered) if link is not None else None

    def _completed(self, _future) -> None:
        self.entered_by_all = time.perf_counter()

    def _entered(self) -> float:
        """When the transfer can start: once every rank has launched the collective (its
        future's completion; the callback may trail `wait()` by a moment: then now; without a
        future, a work still pending here completed when its wait returned)."""
        pending = not self.watched and not self.work.is_completed()
        self.work.wait()
        if self.watched:
            return max(self.launched, self.entered_by_all if self.entered_by_all is not None else time.perf_counter())
        return max(self.launched, time.perf_counter()) if pending else self.launched

    def is_completed(self) -> bool:
        """Done on the wire (the emulated link's delay is applied at `wait()`)."""
        return self.work.is_completed()

    def wait(self) -> bool:
        started = time.perf_counter()
        done = self.work.wait()
        if self.link is not None and self.transfer is not None:
            hold_until(self.link.delivery(self.transfer))
        self.counter.waited(self.label, time.perf_counter() - started)
        return done


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
    link: EmulatedLink | None = None
    """The emulated network link (CPU runs with `parallel.emulate_network`), else None."""

    @property
    def size(self) -> int:
        return len(self.ranks)

    def global_rank(self, index: int) -> int:
        return self.ranks[index]

    @contextmanager
    def _blocking(
        self,
        tensor: torch.Tensor | None,
        operation: str,
        label: str | None = None,
        emulated: bool = True,
        sends: bool = True,
    ) -> Iterator[None]:
        """Count a blocking collective (`sends` False: this rank sends nothing counted, as a
        receive or a broadcast's receivers) and its whole call as waited, held to the emulated
        link's delivery of `tensor`'s bytes."""
        label = label or self.name
        if sends and tensor is not None:
            self.counter.add(label, tensor, operation)
        else:
            self.counter.note(label, operation)
        nbytes = 0 if tensor is None else tensor.numel() * tensor.element_size()
        started = time.perf_counter()
        returned: list[float] = []
        link = self.link if emulated else None
        # queued behind what this rank launched before; on the link once every rank has entered (torch returned)
        transfer = link.launch(nbytes, lambda: returned[0]) if link is not None else None
        yield
        returned.append(time.perf_counter())
        if link is not None and transfer is not None:
            hold_until(link.delivery(transfer))
        self.counter.waited(label, time.perf_counter() - started)

    def _timed(self, work: dist.Work | None, tensor: torch.Tensor, label: str, emulated: bool = True) -> TimedWork:
        assert work is not None, "torch returns no work only to a rank outside the group"
        link = self.link if emulated else None
        return TimedWork(work, label, self.counter, link, tensor.numel() * tensor.element_size())

    # ------------------------------------------------------------------ collectives
    def all_reduce(
        self, tensor: torch.Tensor, op: dist.ReduceOp | dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
    ) -> torch.Tensor:
        if self.size > 1:
            with self._blocking(tensor, "all_reduce"):
                dist.all_reduce(tensor, op=op, group=self.process_group)
        return tensor

    def all_reduce_async(self, tensor: torch.Tensor) -> TimedWork | None:
        """SUM all-reduce of `tensor` in place, launched asynchronously (None when size 1)."""
        if self.size == 1:
            return None
        self.counter.add(self.name, tensor)
        return self._timed(dist.all_reduce(tensor, group=self.process_group, async_op=True), tensor, self.name)

    def all_gather_async(self, tensor: torch.Tensor, output: torch.Tensor) -> TimedWork | None:
        """Every rank's `tensor` stacked along dim 0 of `output` (`[size * n, ...]`, rank order),
        launched asynchronously and counted as `all_gather` (copied, and None, when size 1)."""
        if self.size == 1:
            output.copy_(tensor)
            return None
        self.counter.add(self.name, tensor, "all_gather")
        work = dist.all_gather_single(output, tensor.contiguous(), group=self.process_group, async_op=True)
        return self._timed(work, tensor, self.name)

    def reduce_scatter_async(self, tensor: torch.Tensor, output: torch.Tensor) -> TimedWork | None:
        """SUM reduce-scatter of `tensor` (equal segments along dim 0, rank order) into `output`,
        launched asynchronously and counted as `reduce_scatter` (its full input; copied, and None,
        when size 1)."""
        if self.size == 1:
            output.copy_(tensor)
            return None
        self.counter.add(self.name, tensor, "reduce_scatter")
        work = dist.reduce_scatter_single(output, tensor, group=self.process_group, async_op=True)
        return self._timed(work, tensor, self.name)

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Concatenate every rank's `tensor` along `dim` (rank order)."""
        if self.size == 1:
            return tensor
        tensor = tensor.contiguous()
        with self._blocking(tensor, "all_gather"):
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
        if dim != 0:
            tensor = tensor.movedim(dim, 0)
        output = tensor.new_empty((tensor.shape[0] // self.size, *tensor.shape[1:]))
        with self._blocking(tensor, "reduce_scatter"):
            dist.reduce_scatter_single(output, tensor.contiguous(), group=self.process_group)
        return output.movedim(0, dim).contiguous() if dim != 0 else output

    def broadcast(self, tensor: torch.Tensor, source_index: int) -> torch.Tensor:
        if self.size > 1:
            with self._blocking(tensor, "broadcast", sends=self.rank == source_index):
                dist.broadcast(tensor, src=self.ranks[source_index], group=self.process_group)
        return tensor

    def all_to_all(self, tensor: torch.Tensor) -> torch.Tensor:
        """Equal splits along dim 0: slice i goes to rank i, slice j of the output came from rank j."""
        if self.size == 1:
            return tensor
        output = torch.empty_like(tensor)
        with self._blocking(tensor, "all_to_all"):
            dist.all_to_all_single(output, tensor.contiguous(), group=self.process_group)
        return output

    def all_to_all_uneven(
        self, tensor: torch.Tensor, send: list[int], receive: list[int], label: str | None = None
    ) -> torch.Tensor:
        """Along dim 0 with host split sizes: `send[j]` rows go to rank j, `receive[j]` come from it.
        Counted under `label` (default: the group's name)."""
        if self.size == 1:
            return tensor
        output = tensor.new_empty(sum(receive), *tensor.shape[1:])
        with self._blocking(tensor, "all_to_all", label):
            dist.all_to_all_single(output, tensor.contiguous(), receive, send, group=self.process_group)
        return output

    def all_to_all_async(
        self,
        tensor: torch.Tensor,
        output: torch.Tensor,
        send: list[int] | None = None,
        receive: list[int] | None = None,
        label: str | None = None,
    ) -> TimedWork:
        """`all_to_all` (equal splits) or `all_to_all_uneven` (`send`/`receive` rows per rank) into
        `output`, launched asynchronously and counted under `label` (default: the group's name).
        Needs a group of more than one rank (a caller of size 1 has nothing to exchange)."""
        assert self.size > 1, "an all-to-all within one rank has nothing to launch"
        label = label or self.name
        tensor = tensor.contiguous()
        self.counter.add(label, tensor, "all_to_all")
        work = dist.all_to_all_single(output, tensor, receive, send, group=self.process_group, async_op=True)
        return self._timed(work, tensor, label)

    def send(self, tensor: torch.Tensor, destination_index: int) -> None:
        with self._blocking(tensor, "send", emulated=False):
            dist.send(tensor.contiguous(), dst=self.ranks[destination_index], group=self.process_group)

    def recv(self, tensor: torch.Tensor, source_index: int) -> torch.Tensor:
        with self._blocking(tensor, "recv", emulated=False, sends=False):
            dist.recv(tensor, src=self.ranks[source_index], group=self.process_group)
        return tensor

    def isend(self, tensor: torch.Tensor, destination_index: int, tag: int = 0, label: str | None = None) -> TimedWork:
        """Non-blocking send of a contiguous `tensor` (unchanged until the work completes),
        counted under `label` (default: the group's name, e.g. `pp.forward` for pipeline hops)."""
        label = label or self.name
        self.counter.add(label, tensor, "isend")
        work = dist.isend(tensor, dst=self.ranks[destination_index], group=self.process_group, tag=tag)
        return self._timed(work, tensor, label, emulated=False)

    def irecv(self, tensor: torch.Tensor, source_index: int, tag: int = 0) -> TimedWork:
        """Non-blocking receive into `tensor` (matched by source and tag on gloo); its wait is
        counted under the group's name."""
        self.counter.note(self.name, "irecv")
        work = dist.irecv(tensor, src=self.ranks[source_index], group=self.process_group, tag=tag)
        return self._timed(work, tensor, self.name, emulated=False)

    def barrier(self) -> None:
        if self.size > 1:
            with self._blocking(None, "barrier", sends=False):
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
