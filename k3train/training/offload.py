"""Saved activations offloaded to host memory (`train.offload_activations`): every tensor autograd
saves in a chunk's forward is copied to host memory as it is saved and copied back when backward
needs it (`torch.autograd.graph.saved_tensors_hooks`, as `torch.autograd.graph.save_on_cpu`),
so the device holds a micro-batch's activations only while its forward or backward runs. The
values are copied, never changed: the loss and gradients are those of the run without it.

On CUDA the copies go to pinned host buffers on a side stream, ordered after the compute that
made each tensor and overlapped with what follows; backward's copy back waits for the copy out
(an event). Parameters, their views and tensors under `min_elements` (scalars, per-row
statistics) stay put.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass
class HostOffload:
    """The saved-tensor hooks and what they moved (bytes out; what the planner's host column
    prices). Each storage is copied once per forward however many saved tensors view it: the
    device storage is held until the forward ends (so the allocator cannot hand its address to
    another tensor meanwhile), and each saved tensor is rebuilt from its storage's host copy."""

    min_elements: int = 1024
    bytes_offloaded: int = 0
    _stream: Any = field(default=None, repr=False)
    _live: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, Any]] = field(default_factory=dict, repr=False)

    def _copy_stream(self, device: torch.device) -> Any:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def _host_copy(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """The bytes of `tensor`'s whole storage in host memory, and the event that ends the copy."""
        storage = tensor.untyped_storage()
        raw = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)  # its bytes, flat
        self.bytes_offloaded += storage.nbytes()
        if tensor.device.type != "cuda":
            return raw.clone(), None  # a host tensor: a real copy all the same
        stream = self._copy_stream(tensor.device)
        stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(stream):
            host = torch.empty(raw.shape, dtype=torch.uint8, pin_memory=True)
            host.copy_(raw, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        return host, done

    def pack(self, tensor: torch.Tensor) -> Any:
        weight = isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter)  # a weight or its view
        if weight or tensor.numel() < self.min_elements or tensor.is_sparse:
            return tensor
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key not in self._live:
            host, done = self._host_copy(tensor)
            self._live[key] = (tensor, host, done)
        _, host, done = self._live[key]
        return (tensor.device, host, done, tensor.dtype, tensor.storage_offset(), tensor.shape, tensor.stride())

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        device, host, done, dtype, offset, shape, stride = packed
        if done is not None:
            torch.cuda.current_stream(device).wait_event(done)
            host = host.to(device, non_blocking=True)
        return torch.empty(0, dtype=dtype, device=host.device).set_(host.untyped_storage(), offset, shape, stride)

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                yield
        finally:
            self._live.clear()  # the device storages may go once the forward has returned


def with_offload(
    base: Callable[[], contextlib.AbstractContextManager], offload: HostOffload | None
) -> Callable[[], contextlib.AbstractContextManager]:
    """`base` (the forward's precision context) with the offload hooks inside it, or `base`."""
    if offload is None:
        return base

    @contextlib.contextmanager
    def both() -> Iterator[None]:
        with base(), offload():
            yield

    return both


__all__ = ["HostOffload", "with_offload"]
