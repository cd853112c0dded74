"""Expert all-to-alls in flight: launched in one place and waited for in another, in forward and
in backward, so that other work runs while the rows travel.

A transport's dispatch and combine are written as *phase generators*: each launches one hop's
exchanges (`launch`), yields, and takes their results when it is resumed. Run to the end at once
(`run_phases`) they are the blocking transport; driven by the dispatcher's overlapped schedule
(`Phased`), other chunks' experts and the shared experts run between a hop's launch and its wait.
A generator yields `MORE` when another hop follows the wait it will do next, `LAST` when the next
resume ends it: the schedule advances a chunk's dispatch by one hop without waiting for its last.

Autograd: `launch` of a tensor that needs gradients puts two nodes in the graph, `_Launch` (the
exchange starts) and `_Wait` (its result is waited for). Their backwards run in the opposite
roles: `_Wait`'s launches the gradient's exchange back, `_Launch`'s waits for it. Autograd runs a
CPU backward on one thread, ready nodes latest-created first, so the nodes created between a
launch and its wait in forward (the other chunks' experts) run between the gradient's launch and
its wait in backward: the backward overlaps as the forward did, and every rank issues the
collectives in the same order (the graph, not timing, decides it).
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import torch

from k3train.parallel.comm import Group

MORE, LAST = "more", "last"
"""What a phase generator yields: another hop follows the next wait (`MORE`), or the next resume
finishes it (`LAST`)."""

Result = TypeVar("Result")
Phases = Generator[str, None, Result]


class _Exchange:
    """One all-to-all and its adjoint: who sends what (`send`/`receive` rows per rank as host
    lists, `None` for equal splits, or `counted`: device counts into buffers of fixed rows), the
    work in flight each way, and the buffers it fills."""

    def __init__(
        self,
        group: Group,
        send: list[int] | None,
        receive: list[int] | None,
        label: str | None,
        counted: Counted | None = None,
    ):
        self.group, self.send, self.receive, self.label = group, send, receive, label
        self.counted = counted
        self.work: Waitable | None = None
        self.grad_work: Waitable | None = None
        self.grad_input: torch.Tensor | None = None
        self.grad_output: torch.Tensor | None = None

    def _output(self, x: torch.Tensor, rows: list[int] | int | None) -> torch.Tensor:
        if rows is None:
            return torch.empty_like(x)
        if isinstance(rows, int):  # a fixed-row buffer: rows past what arrives stay zero
            return x.new_zeros(rows, *x.shape[1:])
        return x.new_empty(sum(rows), *x.shape[1:])

    def start(self, x: torch.Tensor) -> torch.Tensor:
        if self.counted is not None:
            c = self.counted
            output = self._output(x, c.receive_rows)
            self.work = c.exchange.launch(x, output, c.send_counts, c.receive_counts, self.label)
            return output
        output = self._output(x, self.receive)
        self.work = self.group.all_to_all_async(x, output, self.send, self.receive, self.label)
        return output

    def start_backward(self, grad: torch.Tensor) -> None:
        self.grad_input = grad.contiguous()  # kept alive until the exchange completes
        if self.counted is not None:
            c = self.counted
            self.grad_output = self._output(grad, c.send_rows)
            self.grad_work = c.exchange.launch(
                self.grad_input, self.grad_output, c.receive_counts, c.send_counts, self.label
            )
            return
        self.grad_output = self._output(grad, self.send)
        self.grad_work = self.group.all_to_all_async(
            self.grad_input, self.grad_output, self.receive, self.send, self.label
        )


class _Launch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, exchange: _Exchange) -> torch.Tensor:
        ctx.exchange = exchange
        return exchange.start(x)  # filled when the work completes: only `_Wait` reads it

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        exchange = ctx.exchange
        assert exchange.grad_work is not None, "the gradient's exchange starts in _Wait's backward"
        exchange.grad_work.wait()
        grad_x, exchange.grad_input, exchange.grad_output = exchange.grad_output, None, None
        return grad_x, None


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, received: torch.Tensor, exchange: _Exchange) -> torch.Tensor:
        ctx.exchange = exchange
        assert exchange.work is not None
        exchange.work.wait()
        return received.view_as(received)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # the gradient's exchange starts here; `_Launch`'s backward waits for it and returns its
        # result (this node hands `_Launch` the received rows' gradient, the exchange's input)
        ctx.exchange.start_backward(grad)
        return grad, None


class InFlight:
    """An exchange launched by `launch`; `result()` waits for it (once)."""

    def __init__(self, x: torch.Tensor, group: Group, send, receive, label, counted: Counted | None = None):
        self._exchange = _Exchange(group, send, receive, label, counted)
        self._with_grad = x.requires_grad and torch.is_grad_enabled()
        self._received = _Launch.apply(x, self._exchange) if self._with_grad else self._exchange.start(x)

    def result(self) -> torch.Tensor:
        if self._with_grad:
            return _Wait.apply(self._received, self._exchange)
        assert self._exchange.work is not None
        self._exchange.work.wait()
        return self._received


class _Local:
    """The exchange of a group of one rank: the tensor itself."""

    def __init__(self, x: torch.Tensor):
        self._x = x

    def result(self) -> torch.Tensor:
        return self._x


def launch(
    x: torch.Tensor,
    group: Group,
    send: list[int] | None = None,
    receive: list[int] | None = None,
    label: str | None = None,
) -> InFlight | _Local:
    """Start the all-to-all of `x` along dim 0 (equal splits, or `send[j]` rows to rank j and
    `receive[j]` from it); gradients travel back the same way when `x` needs them."""
    if group.size == 1:
        return _Local(x)
    return InFlight(x, group, send, receive, label)


class CountedAllToAll(Protocol):
    """An all-to-all whose split sizes are `[size]` int64 tensors and whose buffers have fixed
    rows (`parallel/device_splits.py`: counts read on the host where that is free, NVSHMEM's
    device-split all-to-all on CUDA)."""

    group: Group

    def launch(
        self,
        tensor: torch.Tensor,
        output: torch.Tensor,
        send_counts: torch.Tensor,
        receive_counts: torch.Tensor,
        label: str | None,
    ) -> Waitable: ...


class Waitable(Protocol):
    def wait(self) -> object: ...


@dataclass(frozen=True)
class Counted:
    """A counted exchange's sizes: device counts each way and the fixed rows of both buffers."""

    exchange: CountedAllToAll
    send_counts: torch.Tensor  # [R] rows to each rank (grouped by destination at the top of the input)
    receive_counts: torch.Tensor  # [R] rows from each rank (source after source at the top of the output)
    send_rows: int  # the input's rows (what the gradient comes back into)
    receive_rows: int  # the output's rows


def launch_counted(
    x: torch.Tensor,
    exchange: CountedAllToAll,
    send_counts: torch.Tensor,
    receive_counts: torch.Tensor,
    receive_rows: int,
    label: str | None = None,
) -> InFlight | _Local:
    """Start the all-to-all of the first `send_counts.sum()` rows of `x` (`send_counts[j]` to rank
    `j`, grouped by destination) into `receive_rows` rows: `receive_counts[j]` from rank `j`, source
    after source, zeros after. The counts stay tensors and every buffer's shape is fixed, so the
    caller's code reads nothing on the host; gradients travel back the same way."""
    group = exchange.group
    if group.size == 1:
        rows = x.new_zeros(receive_rows, *x.shape[1:])
        kept = min(receive_rows, x.shape[0])
        mask = torch.arange(kept, device=x.device) < receive_counts.sum()
        shape = (-1,) + (1,) * (x.dim() - 1)
        return _Local(torch.cat([torch.where(mask.view(shape), x[:kept], 0), rows[kept:]]))
    counted = Counted(exchange, send_counts, receive_counts, x.shape[0], receive_rows)
    return InFlight(x, group, None, None, label, counted)


class Phased(Generic[Result]):
    """A phase generator driven from outside: `start` (its first hop on the wire), `advance` (the
    next hop launched, without the last wait), `finish` (run to the end: its result)."""

    def __init__(self, phases: Phases[Result]):
        self._phases = phases
        self._said: str | None = None
        self._done = False
        self._result: Result | None = None

    def _resume(self) -> None:
        try:
            self._said = next(self._phases)
        except StopIteration as stop:
            self._done, self._result = True, stop.value

    def start(self) -> Phased[Result]:
        if self._said is None and not self._done:
            self._resume()
        return self

    def advance(self) -> None:
        """Launch the next hop if one follows the pending wait; else leave the wait pending."""
        if not self._done and self._said == MORE:
            self._resume()

    def finish(self) -> Result:
        while not self._done:
            self._resume()
        return self._result  # type: ignore[return-value]


def alternate(phases: list[Phases[Result]]) -> list[Result]:
    """Phase generators run in turn, each to its next yield, until every one has ended; their
    results in order. Every rank alternates the same generators the same way, so their
    collectives are issued in the same order everywhere."""
    results: list[Result | None] = [None] * len(phases)
    running = list(range(len(phases)))
    while running:
        for index in list(running):
            try:
                next(phases[index])
            except StopIteration as stop:
                results[index] = stop.value
                running.remove(index)
    return results  # type: ignore[return-value]


def run_phases(phases: Phases[Result]) -> Result:
    """A phase generator run to its end at once: launch, wait, launch, wait (the blocking form)."""
    return Phased(phases).finish()


__all__ = [
    "LAST",
    "alternate",
    "MORE",
    "Counted",
    "CountedAllToAll",
    "InFlight",
    "Phased",
    "Phases",
    "launch",
    "launch_counted",
    "run_phases",
]
