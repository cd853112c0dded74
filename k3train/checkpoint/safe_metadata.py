"""Reading DCP's `.metadata` without running code: an allow-listed unpickler.

torch's `FileSystemReader.read_metadata` calls `pickle.load`, which runs whatever a crafted file
asks for. `read_metadata_safely` admits only the classes torch writes into that file (listed by
unpickling real metadata of every kind k3train saves) and refuses any other global with one line.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from k3train.checkpoint.errors import CheckpointError, one_line

_ALLOWED: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset(
        {
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.distributed.checkpoint._extension": frozenset({"ExtensionRegistry"}),
    "torch.serialization": frozenset({"_get_layout"}),  # a lookup of torch.strided & co by name
    "torch": frozenset({"Size"}),
    "pathlib": frozenset({"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"}),
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"set", "frozenset", "complex", "slice"}),
}
_TORCH_CONSTANTS = (torch.dtype, torch.layout, torch.memory_format)
METADATA_MAX_BYTES = 4 << 30
"""`.metadata` lists each saved chunk (about 200 bytes): far below this even for a K3-sized
model sharded over thousands of ranks; the bound keeps a damaged file from being read whole."""


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata; any global outside the allow-list raises `pickle.UnpicklingError`."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_CONSTANTS):
            return getattr(torch, name)  # torch.float32, torch.strided, torch.contiguous_format
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} (not a checkpoint-metadata class)")


def read_metadata_safely(path: str | Path) -> Metadata:
    """DCP metadata of the checkpoint directory `path` through `MetadataUnpickler`.

    Raises `CheckpointError` (one line) for a file that names anything else or is not metadata."""
    file = Path(path) / ".metadata"
    try:
        size = file.stat().st_size
        if size > METADATA_MAX_BYTES:
            raise CheckpointError(
                f"checkpoint {path} has a .metadata of {size:,} bytes, more than the {METADATA_MAX_BYTES:,} "
                "any checkpoint's index of its tensors needs: it is damaged or not DCP metadata"
            )
        data = file.read_bytes()
        metadata = MetadataUnpickler(io.BytesIO(data)).load()
    except CheckpointError:
        raise
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"checkpoint {path} has a .metadata that is refused: {one_line(e, 200)}") from None
    except Exception as e:  # a damaged pickle can raise almost anything (EOFError, ValueError, ...)
        raise CheckpointError(
            f"checkpoint {path} has an unreadable .metadata ({type(e).__name__}: {one_line(e, 200)})"
        ) from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(
            f"checkpoint {path} has a .metadata holding a {type(metadata).__name__}, not DCP metadata"
        )
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader whose `read_metadata` uses `read_metadata_safely` (or a metadata object
    already read and verified, so a load reads the file once)."""

    def __init__(self, path: str | Path, metadata: Metadata | None = None) -> None:
        super().__init__(str(path))
        self._checkpoint_path = Path(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointError(f"checkpoint {self._checkpoint_path}: per-rank metadata files are not supported")
        metadata = self._metadata if self._metadata is not None else read_metadata_safely(self._checkpoint_path)
        # read_metadata_safely fills in a missing storage_meta; a metadata object passed in came from it
        assert metadata.storage_meta is not None, "metadata not read through read_metadata_safely"
        metadata.storage_meta.load_id = self.load_id
        return metadata
