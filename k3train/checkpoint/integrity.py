"""Per-file checksums of a checkpoint: computed by the rank that wrote each file, recorded in the
manifest when the checkpoint is completed, checked on load and by `tools/verify_checkpoint.py`.

CRC-32 (zlib) over 8 MiB chunks: it finds flipped, zeroed and truncated bytes, releases the GIL
while it runs, and on the machines measured (benchmarks/checkpoint_io.py) is about twice as fast as
SHA-256. It is a guard against damage, not against a forger (a forger is stopped by loading
never running code, `safe_metadata.py` and `values.py`).
"""

from __future__ import annotations

import math
import queue
import zlib
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX

CHECKSUM = "crc32"
_CHUNK = 8 << 20


def file_checksum(path: str | Path) -> dict[str, Any]:
    """{"size": bytes, "crc32": 8 hex digits} of one file."""
    crc = 0
    size = 0
    with open(path, "rb", buffering=0) as f:
        buffer = bytearray(_CHUNK)
        view = memoryview(buffer)
        while True:
            n = f.readinto(buffer)
            if not n:
                break
            crc = zlib.crc32(view[:n], crc)
            size += n
    return {"size": size, CHECKSUM: f"{crc & 0xFFFFFFFF:08x}"}


def checksum_files(root: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """Checksums of `names` (paths relative to `root`)."""
    return {name: file_checksum(root / name) for name in sorted(names)}


def _chunk_bytes(item: Any) -> int:
    """Bytes one write item stores: its chunk's (DCP's own `_item_size` counts the whole tensor)."""
    if item.tensor_data is None:  # a non-tensor value: small
        return 0
    return math.prod(item.tensor_data.chunk.sizes) * item.tensor_data.properties.dtype.itemsize


class ChecksummingWriter(FileSystemWriter):
    """DCP's file writer that remembers which files this rank wrote (`written`), so each rank
    checksums its own files while they are still in the page cache.

    `max_file_bytes`: write consecutive items into files of at most that many tensor bytes (an
    item larger than that gets a file of its own) instead of one file per rank. DCP's writer
    keeps every tensor of the file it is writing alive until the file is closed, so this bounds
    what a save whose tensors are produced one by one (from-hf) holds at once."""

    def __init__(self, path: str | Path, max_file_bytes: int | None = None, **kwargs: Any) -> None:
        super().__init__(str(path), **kwargs)
        self.written: list[str] = []
        self.max_file_bytes = max_file_bytes

    def _bounded_files(self, plan: Any, planner: Any, max_file_bytes: int) -> Any:
        files: queue.Queue = queue.Queue()
        bucket: list[Any] = []
        size = 0
        buckets = []
        for item in plan.items:
            nbytes = _chunk_bytes(item)
            if bucket and size + nbytes > max_file_bytes:
                buckets.append(bucket)
                bucket, size = [], 0
            bucket.append(item)
            size += nbytes
        buckets += [bucket] if bucket else []
        for index, items in enumerate(buckets):
            name = f"{plan.storage_data.prefix}{index}{DEFAULT_SUFFIX}"
            files.put((self.fs.concat_path(self.path, name), name, items))
        return self._write_data(planner, files)

    def write_data(self, plan: Any, planner: Any) -> Any:
        if self.max_file_bytes is None:
            future = super().write_data(plan, planner)  # a completed future: the writes are done
        else:
            future = self._bounded_files(plan, planner, self.max_file_bytes)
        # the else branch is for a concurrent.futures.Future (no wait()), outside DCP's declared type
        results = future.wait() if hasattr(future, "wait") else future.result()  # type: ignore[attr-defined]
        self.written = sorted({r.storage_data.relative_path for r in results})
        return future
