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

The gradient buckets of the last micro-batch's backward (`exposed_gradient_buckets_s`) replay the
same way: each bucket goes on the link once it is full, and only what is still on the link when
the backward ends is exposed.
"""

from __future__ import annotations

import math


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


__all__ = ["exposed_expert_exchange_s", "exposed_gradient_buckets_s", "even_buckets"]
