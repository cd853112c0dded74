"""The per-rank AttnRes block cache of the pipeline (docs/design.md §2.1).

For every micro-batch in flight on a rank, the cache keeps each block representation the rank
has received or produced, once (`block id → tensor`), and an accumulator of that block's
gradient from the rank's own later chunks. A chunk's autograd graph never owns a block: it sees
a detached leaf that shares the cached storage (`leaves`), whose `.grad` is added to the
accumulator after the chunk's backward; the accumulated gradient then goes into the backward of
the chunk that introduced the block on this rank (pushed it, or received it over a hop, which
returns it to the sender). A block is released right after that backward, so the cache of a
micro-batch is empty when the backward of the rank's first chunk for it has finished.

`live` counts the block tensors held, `peak` its maximum; with `trace=True` every change is
recorded as `(event, micro_batch, live)` so a test can hold the count to the theoretical one.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class BlockCacheError(RuntimeError):
    """The cache was asked for something the protocol says cannot happen."""


class BlockCache:
    def __init__(self, trace: bool = False):
        self._values: dict[int, dict[int, torch.Tensor]] = {}
        self._grads: dict[int, dict[int, torch.Tensor]] = {}
        self.live = 0
        self.peak = 0
        self.peak_grads = 0
        self.trace: list[tuple[str, int, int]] | None = [] if trace else None

    # ------------------------------------------------------------------ values
    def put(self, micro_batch: int, block: int, value: torch.Tensor, event: str = "put") -> None:
        """Keep `value` (detached; no copy) as block `block` of `micro_batch`."""
        blocks = self._values.setdefault(micro_batch, {})
        if block in blocks:
            raise BlockCacheError(f"block {block} of micro-batch {micro_batch} is already cached (a second copy)")
        blocks[block] = value.detach()
        self.live += 1
        self.peak = max(self.peak, self.live)
        self._record(event, micro_batch)

    def held(self, micro_batch: int) -> list[int]:
        return sorted(self._values.get(micro_batch, {}))

    def value(self, micro_batch: int, block: int) -> torch.Tensor:
        try:
            return self._values[micro_batch][block]
        except KeyError:
            raise BlockCacheError(
                f"block {block} of micro-batch {micro_batch} is not cached on this rank "
                f"(holds {self.held(micro_batch)})"
            ) from None

    def leaves(self, micro_batch: int, count: int) -> list[torch.Tensor]:
        """Blocks `0 … count-1` as fresh leaves for one chunk's graph (sharing the cached storage)."""
        return [self.value(micro_batch, j).detach().requires_grad_() for j in range(count)]

    def release(self, micro_batch: int, blocks: Iterable[int], event: str = "release") -> None:
        """Drop blocks (value and gradient) once nothing on this rank can use them again."""
        blocks = list(blocks)
        values = self._values.get(micro_batch, {})
        grads = self._grads.get(micro_batch, {})
        undelivered = [block for block in blocks if block in grads]
        if undelivered:
            raise BlockCacheError(
                f"blocks {undelivered} of micro-batch {micro_batch} are released with an undelivered gradient"
            )
        for block in blocks:
            if values.pop(block, None) is not None:
                self.live -= 1
        self._record(event, micro_batch)

    def finish(self, micro_batch: int) -> None:
        """The micro-batch's backward is complete on this rank: nothing may be left."""
        values = self._values.pop(micro_batch, {})
        grads = self._grads.pop(micro_batch, {})
        if values or grads:
            raise BlockCacheError(
                f"micro-batch {micro_batch} finished with blocks {sorted(values)} and gradients "
                f"{sorted(grads)} still cached"
            )

    def drop(self, micro_batch: int) -> None:
        """Forget a micro-batch without checks (forward-only passes)."""
        self.live -= len(self._values.pop(micro_batch, {}))
        self._grads.pop(micro_batch, None)
        self._record("drop", micro_batch)

    # ------------------------------------------------------------------ gradients
    def accumulate(self, micro_batch: int, block: int, grad: torch.Tensor | None) -> None:
        if grad is None:
            return
        grads = self._grads.setdefault(micro_batch, {})
        grads[block] = grad if block not in grads else grads[block] + grad
        self.peak_grads = max(self.peak_grads, sum(len(g) for g in self._grads.values()))

    def pop_grad(self, micro_batch: int, block: int) -> torch.Tensor | None:
        return self._grads.get(micro_batch, {}).pop(block, None)

    # ------------------------------------------------------------------ accounting
    def micro_batches(self) -> list[int]:
        return sorted(mb for mb, blocks in self._values.items() if blocks)

    def storages(self) -> set[int]:
        """Data pointers of every cached block (to check that graphs hold no other copies)."""
        return {t.untyped_storage().data_ptr() for blocks in self._values.values() for t in blocks.values()}

    def all_values(self) -> list[torch.Tensor]:
        return [t for blocks in self._values.values() for t in blocks.values()]

    def _record(self, event: str, micro_batch: int) -> None:
        if self.trace is not None:
            self.trace.append((event, micro_batch, self.live))
