"""All-to-alls whose split sizes are tensors: what the `exact` expert transport sends.

The transport knows every (source, destination) row count from the all-gathered expert counts, as
tensors on the device. An ordinary uneven all-to-all wants those counts as Python lists, which on
CUDA costs a device synchronisation per exchange; a device-split all-to-all takes them as
tensors, with buffers of fixed rows, so a step's shapes never depend on the routing. Two
implementations of `expert_exchange.CountedAllToAll`:

* `HostCounts`: the counts read on the host, then `all_to_all_single` on the prefixes of the
  fixed buffers. Free for tensors in host memory (gloo, the CPU runs and tests); on CUDA it is the
  fallback where NVSHMEM is missing (one synchronisation per exchange).
* `SymmetricCounts`: NVSHMEM's `torch.ops.symm_mem.all_to_all_vdev` on symmetric buffers, on a
  side stream; nothing read on the host. Only the rows that exist cross the wire.

`counted_all_to_all(group)` picks one. Counted bytes are the rows that travel (`HostCounts`) or,
where the counts never reach the host, the fixed send buffer's (an upper bound).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from k3train.parallel.comm import Group, TimedWork


class HostCounts:
    """`CountedAllToAll` with the counts read on the host (free on CPU tensors)."""

    name = "host"

    def __init__(self, group: Group):
        self.group = group

    def launch(self, tensor, output, send_counts, receive_counts, label) -> TimedWork:
        send, receive = send_counts.tolist(), receive_counts.tolist()
        if sum(send) > tensor.shape[0] or sum(receive) > output.shape[0]:
            raise ValueError(
                f"{self.group.name}: a counted all-to-all of {sum(send)} rows out and {sum(receive)} in "
                f"does not fit its buffers of {tensor.shape[0]} and {output.shape[0]} rows"
            )
        return self.group.all_to_all_async(tensor[: sum(send)], output[: sum(receive)], send, receive, label)


@dataclass
class _SymmetricBuffers:
    input: torch.Tensor
    output: torch.Tensor
    in_splits: torch.Tensor  # [R]
    out_splits_offsets: torch.Tensor  # [2, R]: rows from each source, where they start
    free: bool = True


class _StreamWork:
    """A side-stream exchange: `wait()` makes the current stream wait for it, then frees its buffers."""

    def __init__(self, event: torch.cuda.Event, release: Callable[[], None]):
        self.event, self.release = event, release

    def wait(self) -> bool:
        torch.cuda.current_stream().wait_event(self.event)
        self.release()
        return True


class SymmetricCounts:
    """`CountedAllToAll` on NVSHMEM symmetric memory (`all_to_all_vdev`), counts on the device.

    Buffers are symmetric (allocated and rendezvoused collectively: every rank launches the same
    exchanges in the same order, so every rank's pool grows alike), one set per exchange in flight.
    A barrier on the stream before each exchange keeps a peer from writing into a buffer whose last
    contents this rank has not copied out yet."""

    name = "nvshmem"

    def __init__(self, group: Group):
        import torch.distributed._symmetric_memory as symm_mem

        assert group.process_group is not None
        self.group, self._symm_mem = group, symm_mem
        self._group_name = group.process_group.group_name
        self._pool: dict[tuple, list[_SymmetricBuffers]] = {}
        self._stream = torch.cuda.Stream()

    def _take(self, tensor: torch.Tensor, output: torch.Tensor) -> _SymmetricBuffers:
        key = (tuple(tensor.shape), tuple(output.shape), tensor.dtype, tensor.device)
        pool = self._pool.setdefault(key, [])
        for buffers in pool:
            if buffers.free:
                buffers.free = False
                return buffers
        empty, size = self._symm_mem.empty, self.group.size
        buffers = _SymmetricBuffers(
            empty(tuple(tensor.shape), dtype=tensor.dtype, device=tensor.device),
            empty(tuple(output.shape), dtype=output.dtype, device=output.device),
            empty(size, dtype=torch.int64, device=tensor.device),
            empty((2, size), dtype=torch.int64, device=tensor.device),
            free=False,
        )
        for part in (buffers.input, buffers.output, buffers.in_splits, buffers.out_splits_offsets):
            self._symm_mem.rendezvous(part, self._group_name)
        pool.append(buffers)
        return buffers

    def launch(self, tensor, output, send_counts, receive_counts, label) -> _StreamWork:
        buffers = self._take(tensor, output)
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            buffers.input.copy_(tensor)
            buffers.in_splits.copy_(send_counts)
            barrier = dist.barrier(group=self.group.process_group, async_op=True, device_ids=[tensor.device.index])
            assert barrier is not None
            barrier.block_current_stream()
            torch.ops.symm_mem.all_to_all_vdev(
                buffers.input, buffers.output, buffers.in_splits, buffers.out_splits_offsets, self._group_name
            )
            arrived = torch.arange(output.shape[0], device=output.device) < buffers.out_splits_offsets[0].sum()
            shape = (-1,) + (1,) * (output.dim() - 1)
            # rows past what arrived: zero (where, not a product: stale rows may hold NaN bit patterns)
            torch.where(arrived.view(shape), buffers.output, buffers.output.new_zeros(()), out=output)
            event = torch.cuda.Event()
            event.record(self._stream)
        tensor.record_stream(self._stream)
        output.record_stream(self._stream)
        self.group.counter.add(label or self.group.name, tensor, "all_to_all")

        def release() -> None:
            buffers.free = True

        return _StreamWork(event, release)


def nvshmem_usable(group: Group) -> bool:
    """NVSHMEM's device-split all-to-all applies: an NCCL group on CUDA with NVSHMEM installed."""
    if group.process_group is None or not torch.cuda.is_available():
        return False
    if dist.get_backend(group.process_group) != "nccl":
        return False
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError:
        return False
    return bool(symm_mem.is_nvshmem_available())


def counted_all_to_all(group: Group) -> HostCounts | SymmetricCounts:
    """NVSHMEM's device-split all-to-all where it applies, else the counts read on the host."""
    if nvshmem_usable(group):
        import torch.distributed._symmetric_memory as symm_mem

        symm_mem.set_backend("NVSHMEM")
        return SymmetricCounts(group)
    return HostCounts(group)


__all__ = ["HostCounts", "SymmetricCounts", "counted_all_to_all", "nvshmem_usable"]
