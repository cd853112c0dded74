"""The exposed time of the overlapped expert all-to-alls (`parallel.ep_overlap_chunks`), from the
schedule the dispatcher runs (`parallel/expert_overlap.py`), replayed on one link and one
compute stream per rank.

Forward of one MoE layer, `n` chunks: every chunk's dispatch (`d` seconds on the wire each) is
launched at once and the link carries them one after another; the shared experts (`S`) run
first; chunk `i`'s experts (`e`) start when its rows have arrived and the previous chunk's
experts are done, and its combine (`c`) is launched after them (queued behind what the link
still carries). The layer ends when the last combine has arrived. Backward runs it mirrored
(autograd's order, `parallel/expert_exchange.py`): every chunk's combine gradient launched at
once, last chunk first, each chunk's expert backward (`2e`) when its gradient has arrived, its
dispatch gradient launched after, the shared experts' backward (`2S`) after the last chunk's.
Exposed = the layer's end minus its compute. Latency is not modelled (the planner prices bytes
over bandwidth); with `n = 0` nothing overlaps and the exposed time is all of `2·n·(d + c)`.

An overlapped tensor-parallel entry (`parallel.tp_overlap_chunks`, `parallel/tensor_overlap.py`)
of one region (a mixer or an MLP): forward, the sequence-parallel all-gather in `n` pieces (`g` each on the
wire), each piece's entry GEMMs (`f/n`) once it has arrived; backward, each piece's input
gradient (`f/n`, the same FLOPs) is reduce-scattered (`r` each) as soon as it is made, under the
rest and then the weight-gradient GEMMs (`f`); without sequence parallelism no forward
collective and one all-reduce under the weight gradients. Its overlapped leave (the row-parallel
projection, `l` of forward GEMMs): forward, each piece's partial product (`l/n`) then its
reduce-scatter or all-reduce (`r` each) under the next piece's; backward (sequence parallel),
the output gradient's all-gather in `n` pieces (`g` each), each piece's input gradient (`l/n`)
once it has arrived, then the weight gradient (`l`); without sequence parallelism no backward
collective.

The gradient buckets of the last micro-batch's backward (`exposed_gradient_buckets_s`) replay the
same way: each bucket goes on the link once it is full, and only what is still on the link when
the backward ends is exposed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def _replay(transfer_s: float, returns_s: float, chunk_s: float, before_s: float, after_s: float, chunks: int) -> float:
    """Exposed seconds of one direction: `chunks` first transfers launched at once, `before_s` of
    compute, then per chunk wait → `chunk_s` of compute → its return transfer, then `after_s`."""
    link = 0.0
    arrived = []
    for _ in range(chunks):
        link += transfer_s
        arrived.append(link)
    clock = before_s
    for index in range(chunks):
        clock = max(clock, arrived[index]) + chunk_s
        link = max(link, clock) + returns_s
    clock += after_s
    end = max(clock, link)
    return end - (before_s + chunks * chunk_s + after_s)


def exposed_expert_exchange_s(
    exchange_s: float, experts_forward_s: float, shared_forward_s: float, chunks: int
) -> float:
    """Exposed seconds of one MoE layer's expert all-to-alls in one micro-batch's forward and
    backward. `exchange_s`: their whole time on the wire (dispatch and combine, forward and
    backward: four equal parts); `experts_forward_s` / `shared_forward_s`: the routed and the
    shared experts' forward compute (their backward is twice it)."""
    if chunks <= 0:
        return exchange_s
    part = exchange_s / 4 / chunks  # one chunk's dispatch (or combine), one direction
    forward = _replay(part, part, experts_forward_s / chunks, shared_forward_s, 0.0, chunks)
    backward = _replay(part, part, 2 * experts_forward_s / chunks, 0.0, 2 * shared_forward_s, chunks)
    return forward + backward


@dataclass(frozen=True)
class LayerWork:
    """One decoder layer of a stage, for `exposed_alternating_halves_s`: forward seconds of one
    micro-batch's work before its MoE exchange (`before_s`: AttnRes, norms, the mixer, router and
    latent projections; a dense layer's MLP too), of its routed and shared experts, and its
    expert exchanges' whole time on the wire (`exchange_s`: dispatch and combine, forward and
    backward; 0 for a dense layer)."""

    before_s: float
    exchange_s: float = 0.0
    experts_s: float = 0.0
    shared_s: float = 0.0


def _half_segments(layers: list[LayerWork], half: str, chunks: int):
    """The operations of one half of the micro-batch between its yields, as `K3ModelChunk`
    alternates them (`parallel.ep_overlap_halves`): per MoE layer its work before the exchange,
    the loads all-gather (behind what the link still carries), every chunk's dispatch, the shared
    experts, then a yield; per chunk wait, experts, combine, then a yield; the combines are
    waited for when the half resumes (and goes on to its next layer)."""
    segment: list[tuple] = []
    for index, work in enumerate(layers):
        segment.append(("compute", work.before_s / 2))
        if work.exchange_s <= 0:
            continue
        part = work.exchange_s / 8 / chunks  # one chunk of one half, one direction, forward
        segment.append(("sync",))
        segment += [("launch", (index, half, "dispatch", c), part) for c in range(chunks)]
        segment.append(("compute", work.shared_s / 2))
        yield segment
        segment = []
        for c in range(chunks):
            segment += [
                ("wait", (index, half, "dispatch", c)),
                ("compute", work.experts_s / 2 / chunks),
                ("launch", (index, half, "combine", c), part),
            ]
        yield segment
        segment = [("wait", (index, half, "combine", c)) for c in range(chunks)]
    yield segment


def _run_program(program: list[tuple]) -> float:
    """Exposed seconds of a rank's operations on one compute stream and one link: a launch goes
    on the link when it is free (in launch order), a wait holds compute until that transfer has
    arrived, a sync until the link is free (a blocking collective behind the ones in flight)."""
    clock = link = busy = 0.0
    arrival = {}
    for operation in program:
        kind = operation[0]
        if kind == "compute":
            clock += operation[1]
            busy += operation[1]
        elif kind == "launch":
            link = max(clock, link) + operation[2]
            arrival[operation[1]] = link
        elif kind == "wait":
            clock = max(clock, arrival[operation[1]])
        else:  # sync
            clock = max(clock, link)
    return max(clock, link) - busy


def _backward_program(forward: list[tuple]) -> list[tuple]:
    """Autograd's mirror of `forward` (latest-created first, `parallel/expert_exchange.py`): the
    operations reversed, compute twice as long, a wait's gradient launched where the wait was and
    waited for where the launch was; the loads all-gather has no backward."""
    sizes = {operation[1]: operation[2] for operation in forward if operation[0] == "launch"}
    program: list[tuple] = []
    for operation in reversed(forward):
        if operation[0] == "compute":
            program.append(("compute", 2 * operation[1]))
        elif operation[0] == "wait":
            program.append(("launch", operation[1], sizes[operation[1]]))
        elif operation[0] == "launch":
            program.append(("wait", operation[1]))
    return program


def exposed_alternating_halves_s(layers: list[LayerWork], chunks: int) -> float:
    """Exposed seconds of a stage's expert exchanges in one micro-batch's forward and backward
    when the micro-batch runs as two halves whose layers alternate (`parallel.ep_overlap_halves`,
    each half's exchange in `chunks` chunks): half A's all-to-alls travel while half B computes
    its mixer and experts, and the other way round; backward mirrored."""
    if chunks < 1:
        raise ValueError(f"the alternating halves run the chunked exchange: chunks >= 1, got {chunks}")
    halves = [_half_segments(layers, "a", chunks), _half_segments(layers, "b", chunks)]
    forward: list[tuple] = []
    running = [0, 1]
    while running:  # as `expert_exchange.alternate`: each half to its next yield, in turn
        for half in list(running):
            segment = next(halves[half], None)
            if segment is None:
                running.remove(half)
            else:
                forward += segment
    return _run_program(forward) + _run_program(_backward_program(forward))


def exposed_tensor_entry_s(gather_s: float, reduce_s: float, entry_forward_s: float, pieces: int) -> float:
    """Exposed seconds of one overlapped TP entry in one micro-batch's forward and backward:
    `gather_s` / `reduce_s` its all-gather (0 without sequence parallelism) and its gradient's
    reduce-scatter (or all-reduce) on the wire, `entry_forward_s` its column-parallel GEMMs'
    forward compute, `pieces` (≥ 1) the pieces of the sequence."""
    if pieces < 1:
        raise ValueError(f"an overlapped entry runs in at least one piece, got {pieces}")
    piece_s = entry_forward_s / pieces
    forward = _replay(gather_s / pieces, 0.0, piece_s, 0.0, 0.0, pieces) if gather_s > 0 else 0.0
    backward = _replay(0.0, reduce_s / pieces, piece_s, 0.0, entry_forward_s, pieces)
    return forward + backward


def exposed_tensor_leave_s(reduce_s: float, gather_s: float, leave_forward_s: float, pieces: int) -> float:
    """Exposed seconds of one overlapped TP leave in one micro-batch's forward and backward:
    `reduce_s` its forward reduce-scatter (or all-reduce) on the wire, `gather_s` its output
    gradient's all-gather (0 without sequence parallelism), `leave_forward_s` its row-parallel
    GEMM's forward compute, `pieces` (≥ 1) the pieces of the sequence."""
    if pieces < 1:
        raise ValueError(f"an overlapped leave runs in at least one piece, got {pieces}")
    piece_s = leave_forward_s / pieces
    forward = _replay(0.0, reduce_s / pieces, piece_s, 0.0, 0.0, pieces)
    backward = _replay(gather_s / pieces, 0.0, piece_s, 0.0, leave_forward_s, pieces) if gather_s > 0 else 0.0
    return forward + backward


def exposed_gradient_buckets_s(buckets: list[tuple[float, float]], backward_s: float) -> float:
    """Exposed seconds of the gradient buckets of the step's last backward (`backward_s` long):
    `buckets` are `(seconds on the link, share of the backward done when the bucket is full)` in
    launch order; each starts when it is full and the link is free (one after another), and what
    the last one still has to carry when the backward ends is exposed. A bucket holding the
    first layers (the embedding) is full only at the end, so its whole time is exposed."""
    link = 0.0
    for seconds, ready_share in buckets:
        link = max(link, ready_share * backward_s) + seconds
    return max(0.0, link - backward_s)


def even_buckets(total_s: float, bucket_s: float) -> list[tuple[float, float]]:
    """`total_s` of gradients in buckets of `bucket_s` (the last one smaller), full at even shares
    of the backward: the layout search's model, which builds no reducer."""
    if total_s <= 0:
        return []
    count = max(1, math.ceil(total_s / bucket_s - 1e-9))
    sizes = [bucket_s] * (count - 1) + [total_s - bucket_s * (count - 1)]
    return [(size, (index + 1) / count) for index, size in enumerate(sizes)]


__all__ = [
    "exposed_expert_exchange_s",
    "exposed_tensor_entry_s",
    "exposed_tensor_leave_s",
    "exposed_gradient_buckets_s",
    "even_buckets",
]
