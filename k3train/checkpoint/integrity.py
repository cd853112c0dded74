"""Per-file checksums of a checkpoint: computed by the rank that wrote each file, recorded in the
manifest when the checkpoint is completed, checked on load and by `tools/verify_checkpoint.py`.

CRC-32 (zlib) over 8 MiB chunks: it finds flipped, zeroed and truncated bytes, releases the GIL
while it runs, and on the machines measured (benchmarks/checkpoint_io.py) is about twice as fast as
SHA-256. It is a guard against damage, not against a forger (a forger is stopped by loading
never running code, `safe_metadata.py` and `values.py`).
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter

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


class ChecksummingWriter(FileSystemWriter):
    """DCP's file writer that remembers which files this rank wrote (`written`), so each rank
    checksums its own files while they are still in the page cache."""

    def __init__(self, path: str | Path, **kwargs: Any) -> None:
        super().__init__(str(path), **kwargs)
        self.written: list[str] = []

    def write_data(self, plan: Any, planner: Any) -> Any:
        future = super().write_data(plan, planner)  # a completed future: the writes are done
        # the else branch is for a concurrent.futures.Future (no wait()), outside DCP's declared type
        results = future.wait() if hasattr(future, "wait") else future.result()  # type: ignore[attr-defined]
        self.written = sorted({r.storage_data.relative_path for r in results})
        return future
