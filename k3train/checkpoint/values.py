"""Non-tensor checkpoint values as tagged JSON instead of pickles.

DCP stores every non-tensor leaf of a state dict as an opaque byte string and, by default, writes
it with `torch.save` (a pickle). k3train writes those bytes as JSON behind a magic prefix and reads
nothing else back, so a crafted value in a `.distcp` file cannot run code on load. JSON has no
tuples, non-string dict keys, bytes or arrays; those are written as `{"__k3__": tag, ...}`
objects, which covers what k3train saves (progress counters, data positions, optimizer options,
Python and numpy RNG states, small tensors inside options).
"""

from __future__ import annotations

import base64
import io
import json
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from k3train.checkpoint.bounded_json import json_text
from k3train.checkpoint.errors import CheckpointError, one_line

MAGIC = b"K3JSON1\n"
"""The first bytes of every non-tensor value k3train writes."""
TAG = "__k3__"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r}")
    return dtype


def _to_json(value: Any, where: str) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [_to_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {TAG: "tuple", "items": [_to_json(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and TAG not in value:
            return {k: _to_json(v, f"{where}.{k}") for k, v in value.items()}
        return {TAG: "dict", "items": [[_to_json(k, where), _to_json(v, f"{where}.{k}")] for k, v in value.items()]}
    if isinstance(value, (bytes, bytearray)):
        return {TAG: "bytes", "data": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, torch.dtype):
        return {TAG: "dtype", "name": _dtype_name(value)}
    if isinstance(value, torch.Tensor):
        cpu = value.detach().to("cpu").contiguous()
        raw = cpu.view(torch.uint8).numpy().tobytes() if cpu.numel() else b""
        return {
            TAG: "tensor",
            "dtype": _dtype_name(cpu.dtype),
            "shape": list(cpu.shape),
            "data": base64.b64encode(raw).decode("ascii"),
        }
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is a dependency
        np = None  # type: ignore[assignment]  # optional-import idiom; checked for None below
    if np is not None and isinstance(value, (np.ndarray, np.generic)):
        array = np.ascontiguousarray(value)
        return {
            TAG: "ndarray",
            "dtype": array.dtype.str,
            "shape": list(array.shape),
            "scalar": isinstance(value, np.generic),
            "data": base64.b64encode(array.tobytes()).decode("ascii"),
        }
    raise CheckpointError(
        f"cannot save {where} (a {type(value).__name__}): checkpoint values other than tensors must be "
        "None, bool, int, float, str, list, tuple, dict, bytes, numpy arrays or torch dtypes"
    )


def _from_json(value: Any) -> Any:
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    if not isinstance(value, dict):
        return value
    tag = value.get(TAG)
    if tag is None:
        return {k: _from_json(v) for k, v in value.items()}
    if tag == "tuple":
        return tuple(_from_json(v) for v in value["items"])
    if tag == "dict":
        return {_from_json(k): _from_json(v) for k, v in value["items"]}
    if tag == "bytes":
        return base64.b64decode(value["data"], validate=True)
    if tag == "dtype":
        return _torch_dtype(value["name"])
    if tag == "tensor":
        dtype = _torch_dtype(value["dtype"])
        shape = [int(s) for s in value["shape"]]
        raw = bytearray(base64.b64decode(value["data"], validate=True))
        flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        return flat.view(dtype).reshape(shape).clone()
    if tag == "ndarray":
        import numpy as np

        np_dtype = np.dtype(str(value["dtype"]))
        if np_dtype.hasobject:
            raise ValueError("object arrays are not allowed")
        array = np.frombuffer(base64.b64decode(value["data"], validate=True), dtype=np_dtype)
        array = array.reshape([int(s) for s in value["shape"]]).copy()
        return array[()] if value.get("scalar") else array
    raise ValueError(f"unknown tag {tag!r}")


def encode_value(value: Any, where: str = "value") -> bytes:
    """`value` as the bytes k3train stores for a non-tensor checkpoint entry."""
    text = json.dumps(_to_json(value, where), separators=(",", ":"), allow_nan=True)
    return MAGIC + text.encode("utf-8")


def decode_value(data: bytes, where: str = "value") -> Any:
    """The value `encode_value` wrote; `CheckpointError` for anything else (a pickle included:
    it is never unpickled)."""
    if not data.startswith(MAGIC):
        kind = "a pickle" if data[:1] in (b"\x80", b"PK") or data[:2] == b"PK" else "not a k3train value"
        raise CheckpointError(
            f"{where} is {kind} (k3train writes non-tensor values as JSON and never unpickles them); "
            "the checkpoint was written by another tool or an older k3train, or was tampered with"
        )
    try:
        return _from_json(json_text(data[len(MAGIC) :].decode("utf-8")))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{where} is a damaged k3train value ({type(e).__name__}: {one_line(e, 160)})") from None


class JsonSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, writing non-tensor values with `encode_value` (not a pickle)."""

    def transform_object(self, write_item: WriteItem, object: Any):
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(encode_value(object, write_item.index.fqn))
        return object
