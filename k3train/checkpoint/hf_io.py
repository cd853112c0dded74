"""Read-only I/O for the Hugging Face conversion: finding a k3train checkpoint and its run config,
reading its model tensors a few at a time (`CheckpointTensorReader`), reading a hub-format
directory (`HFDirectory`) and loading its weights into a `K3ModelChunk`. Nothing here modifies what
it reads; the name/shape mapping and config.json conversion it relies on are in `hf.py`."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from k3train.checkpoint.bounded_json import json_file
from k3train.checkpoint.containment import contained, escapes
from k3train.checkpoint.errors import CheckpointError, describe_failure, one_line
from k3train.checkpoint.hf import HFConversionError, TensorSpec, import_tensor, short_listing
from k3train.checkpoint.manifest import complete_checkpoints, is_complete, resume_hint
from k3train.checkpoint.safe_metadata import SafeFileSystemReader
from k3train.checkpoint.verify import verify_checkpoint
from k3train.model.config import ModelConfig


def find_checkpoint(path: str | Path) -> Path:
    """The complete k3train checkpoint `path` names: a `step_NNNNNNNN` directory, a checkpoint
    directory (its newest complete step) or a run directory (`RUN/checkpoints`, newest step).

    Never modifies anything (unlike `Checkpointer(...)`, which cleans stale saves on start-up).
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise HFConversionError(f"checkpoint {path} does not exist")
    if is_complete(path):
        return path
    for root in (path, path / "checkpoints"):
        steps = complete_checkpoints(root)
        if steps:
            return steps[-1][1]
    raise HFConversionError(
        f"{path} is neither a complete k3train checkpoint (step_NNNNNNNN with .metadata and a complete "
        "k3train.json) nor a directory holding one (checkpoints/ of a run)"
    )


def run_config_path(checkpoint: Path, explicit: str | Path | None = None) -> Path:
    """The run's `config.yaml`: `explicit` when given, else `CHECKPOINT/../../config.yaml`."""
    if explicit is not None:
        path = Path(explicit).expanduser()
        if not path.is_file():
            raise HFConversionError(f"--config {path} is not a file")
        return path
    path = checkpoint.resolve().parent.parent / "config.yaml"
    if not path.is_file():
        raise HFConversionError(
            f"no config.yaml next to the checkpoint's run directory ({path} does not exist); pass "
            "--config RUN_DIR/config.yaml (the resolved config the run wrote)"
        )
    return path


class CheckpointTensorReader:
    """Reads a k3train DCP checkpoint's model tensors a few at a time (one `dcp.load` per batch,
    with a partial state dict), whatever layout saved it: DCP reshards every saved chunk into the
    requested plain tensor or slice of one. Peak memory ≈ the requested batch plus the largest
    saved chunk it touches (DCP's file reader loads a saved chunk whole)."""

    def __init__(self, path: str | Path, app_key: str = "model") -> None:
        self.path = Path(path)
        try:
            self.metadata = verify_checkpoint(self.path)
        except CheckpointError as error:
            raise HFConversionError(str(error)) from None
        metadata = self.metadata
        self._reader = SafeFileSystemReader(self.path, metadata)  # one metadata read, not one per dcp.load
        self.fqns: dict[str, str] = {}
        planner_data = dict(metadata.planner_data or {})
        for fqn, md in metadata.state_dict_metadata.items():
            path_ = planner_data.get(fqn)
            if path_ is not None and len(path_) == 2 and path_[0] == app_key:
                name = str(path_[1])
            elif path_ is None and fqn.startswith(app_key + "."):
                name = fqn[len(app_key) + 1 :]
            else:
                continue
            if hasattr(md, "chunks"):  # tensors only
                self.fqns[name] = fqn

    def _tensor_metadata(self, name: str) -> TensorStorageMetadata:
        md = self.metadata.state_dict_metadata[self.fqns[name]]
        assert isinstance(md, TensorStorageMetadata), "fqns holds tensors only (entries with chunks)"
        return md

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(self._tensor_metadata(name).size) for name in self.fqns}

    def dtype(self, name: str) -> torch.dtype:
        return self._tensor_metadata(name).properties.dtype

    def dim0_boundaries(self, name: str) -> list[int]:
        """Where saved chunks start or end along dim 0 (e.g. expert-parallel shards)."""
        md = self._tensor_metadata(name)
        cuts = {0, int(md.size[0])}
        for chunk in md.chunks:
            cuts.add(int(chunk.offsets[0]))
            cuts.add(int(chunk.offsets[0] + chunk.sizes[0]))
        return sorted(cuts)

    def check_names(self, expected: Mapping[str, tuple[int, ...]]) -> None:
        """Raise `HFConversionError` unless the checkpoint's model tensors are exactly `expected`."""
        have = self.shapes()
        missing = [n for n in expected if n not in have]
        extra = [n for n in have if n not in expected]
        wrong = [f"{n} {list(have[n])} vs {list(s)}" for n, s in expected.items() if n in have and have[n] != tuple(s)]
        problems = []
        if missing:
            problems.append(f"missing model tensors the config implies: {short_listing(missing)}")
        if extra:
            problems.append(
                f"model tensors the config does not imply (or the HF mapping does not cover): {short_listing(extra)}"
            )
        if wrong:
            problems.append(f"shapes (checkpoint vs config): {short_listing(wrong)}")
        if problems:
            raise HFConversionError(
                f"checkpoint {self.path} does not match its config ({'; '.join(problems)}); is --config the "
                "run's config.yaml?"
            )

    def read(self, requests: Sequence[tuple[str, tuple[int, int] | None]]) -> list[torch.Tensor]:
        """One `dcp.load`: each request is (name, None) for a whole tensor or (name, (start, end))
        for rows [start, end) along dim 0; tensors come back in the checkpoint's dtype."""
        targets: dict[str, tuple[torch.Tensor, tuple[int, ...]]] = {}
        out = []
        for name, rows in requests:
            fqn = self.fqns[name]
            md = self._tensor_metadata(name)
            size = list(md.size)
            offsets = [0] * len(size)
            if rows is not None:
                offsets[0], size[0] = rows[0], rows[1] - rows[0]
            if fqn in targets:
                raise ValueError(f"{name} requested twice in one read")
            tensor = torch.empty(size, dtype=md.properties.dtype)
            targets[fqn] = (tensor, tuple(offsets))
            out.append(tensor)
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=r".*torch\.distributed is disabled.*")
                warnings.filterwarnings("ignore", message=r"Detected pickle protocol")  # a crafted slot's
                dcp.load({}, storage_reader=self._reader, planner=_SliceLoadPlanner(targets), no_dist=True)
        except (Exception, CheckpointException) as e:  # a damaged or crafted tensor slot (a pickle, garbage)
            found = describe_failure(e)
            if "UnpicklingError" in found:  # torch's text advises weights_only=False: running the file's code
                found = "a tensor slot holds something other than a plain tensor; refused, nothing in it was run"
            raise CheckpointError(
                f"reading tensors of checkpoint {self.path} failed ({found}); the files may be damaged: "
                f"{resume_hint(self.path)}"
            ) from None
        return out


class _SliceLoadPlanner(LoadPlanner):
    """Reads `{fqn: (destination, offsets)}`: the region of each saved tensor that starts at
    `offsets` and has the destination's size, through DCP's resharding read items (one item per
    saved chunk the region overlaps)."""

    def __init__(self, targets: dict[str, tuple[torch.Tensor, tuple[int, ...]]]) -> None:
        self.targets = targets
        self.metadata: Metadata | None = None

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None, "set_up_planner runs before create_local_plan"
        items = []
        for fqn, (tensor, offsets) in self.targets.items():
            md = self.metadata.state_dict_metadata[fqn]
            assert isinstance(md, TensorStorageMetadata), "targets are tensors only"
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=tensor.size())
            items += create_read_items_for_chunk_list(fqn, md, [chunk])
        return LoadPlan(items)

    def create_global_plan(self, global_plan):
        return global_plan

    def finish_plan(self, central_plan):
        return central_plan

    def load_bytes(self, read_item, value) -> None:
        raise RuntimeError(f"unexpected non-tensor read of {read_item.dest_index.fqn}")

    def resolve_tensor(self, read_item) -> torch.Tensor:
        tensor = self.targets[read_item.dest_index.fqn][0]
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            tensor = tensor.narrow(dim, start, length)
        return tensor

    def commit_tensor(self, read_item, tensor) -> None:
        pass  # resolve_tensor handed out a view of the destination: nothing to copy back


class HFDirectory:
    """A hub-format directory: `config.json` plus `model.safetensors` or sharded
    `model-*.safetensors` with `model.safetensors.index.json`. Tensors are read one at a time,
    with one shard file open at a time."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()
        config_path = contained(self.path, "config.json", HFConversionError)
        if not config_path.is_file():
            raise HFConversionError(f"{self.path} has no config.json: not a Hugging Face model directory")
        self.config = _read_json_object(config_path)
        index = contained(self.path, "model.safetensors.index.json", HFConversionError)
        single = contained(self.path, "model.safetensors", HFConversionError)
        indexed: dict[str, Path] | None  # tensor name → shard file, from the index (None: one file)
        if index.is_file():
            weight_map = _read_json_object(index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise HFConversionError(f"{index}: weight_map must be a non-empty object of tensor name → shard file")
            indexed = {str(name): self._shard_path(index, name, file) for name, file in weight_map.items()}
        elif single.is_file():
            indexed = None
            self._single = single
        else:
            raise HFConversionError(f"{self.path} has neither model.safetensors.index.json nor model.safetensors")
        self._open: dict[Path, Any] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        files = sorted(set(indexed.values())) if indexed is not None else [single]
        for file in files:
            if not file.is_file():
                raise HFConversionError(f"{file} is listed in the index but missing")
            handle = self._handle(file)
            try:
                for name in handle.keys():
                    self._shapes[name] = tuple(handle.get_slice(name).get_shape())
            except Exception as e:  # safetensors raises its own error types
                raise HFConversionError(
                    f"{file} is not a valid safetensors file ({type(e).__name__}: {one_line(e, 200)})"
                ) from None
        if indexed is None:
            self.files: dict[str, Path] = {name: single for name in self._shapes}
        else:
            absent = [n for n in indexed if n not in self._shapes]
            if absent:
                raise HFConversionError(f"index names tensors its shards do not hold: {short_listing(absent)}")
            self.files = indexed

    @staticmethod
    def is_hf_dir(path: str | Path) -> bool:
        path = Path(path)
        return (path / "config.json").is_file() and (
            (path / "model.safetensors.index.json").is_file() or (path / "model.safetensors").is_file()
        )

    def _shard_path(self, index: Path, name: Any, file: Any) -> Path:
        """The shard `file` of tensor `name`: a plain file name inside this directory (an absolute
        path, `..` or a link leading outside is refused: an index is not trusted to name files)."""
        if not isinstance(file, str) or not file or Path(file).is_absolute() or ".." in Path(file).parts:
            raise HFConversionError(
                f"{index}: weight_map[{str(name)!r}] = {file!r} is not a file name inside {self.path}"
            )
        path = self.path / file
        if escapes(self.path, path) is not None:
            raise HFConversionError(f"{index}: weight_map[{str(name)!r}] = {file!r} leads outside {self.path}")
        return path

    def _handle(self, file: Path):
        from safetensors import safe_open

        if file not in self._open:
            # One shard open at a time: an open shard's pages that were read stay resident (it is
            # memory-mapped), so keeping every shard open would hold the whole folder by the end.
            self._open.clear()
            try:
                self._open[file] = safe_open(str(file), framework="pt")
            except Exception as e:  # a bad header: safetensors raises SafetensorError or OSError
                raise HFConversionError(
                    f"{file} is not a valid safetensors file ({type(e).__name__}: {one_line(e, 200)})"
                ) from None
        return self._open[file]

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self._shapes)

    def get(self, name: str) -> torch.Tensor:
        file = self.files[name]
        try:
            return self._handle(file).get_tensor(name)
        except HFConversionError:
            raise
        except Exception as e:
            raise HFConversionError(
                f"{file}: tensor {name} cannot be read ({type(e).__name__}: {one_line(e, 200)})"
            ) from None


HF_JSON_MAX_BYTES = 256 << 20
"""config.json and the index are kilobytes to a few megabytes; a larger file is not one."""


def _read_json_object(path: Path) -> dict:
    """A JSON file that must hold an object; one line (`HFConversionError`) otherwise."""
    try:
        value = json_file(path, HF_JSON_MAX_BYTES)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise HFConversionError(f"{path} is not valid JSON ({type(e).__name__}: {one_line(e, 160)})") from None
    if not isinstance(value, dict):
        raise HFConversionError(f"{path} must hold a JSON object, not a {type(value).__name__}")
    return value


def build_empty_model(config: ModelConfig):
    """`K3ModelChunk(config)` with uninitialised (CPU) parameters, for loading every tensor: built on
    the meta device, so nothing is initialised twice; non-persistent buffers are zeroed."""
    from k3train.model.k3 import K3ModelChunk

    with torch.device("meta"):
        model = K3ModelChunk(config)
    # to_empty() gives every module its own new Parameter, which unties shared ones (a tied
    # head): remember who shared what and tie again afterwards.
    shared: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        shared.setdefault(id(param), []).append(name)
    model.to_empty(device="cpu")
    for names in shared.values():
        owner = model.get_parameter(names[0])
        for name in names[1:]:
            module_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(module_name), attr, owner)
    persistent = set(model.state_dict())
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name not in persistent:
                buffer.zero_()
    return model


def check_imported_dtype(name: str, stored: torch.dtype, wanted: torch.dtype, source: Path) -> None:
    """Refuse a stored dtype whose cast to the model's would change what the values mean: an
    integer or bool tensor for a floating-point parameter (F32 bytes labelled I32 read as
    integers), or any other dtype for an integer or bool buffer. Floating widths convert."""
    if wanted.is_floating_point and stored.is_floating_point:
        return
    if stored == wanted:
        return
    raise HFConversionError(
        f"{source}: tensor {name} is stored as {str(stored).removeprefix('torch.')}, the model holds "
        f"{str(wanted).removeprefix('torch.')} there (a cast would change its values' meaning); "
        "re-export the weights in a floating-point dtype"
    )


def imported_value(
    hf: HFDirectory, spec: TensorSpec, wanted: torch.dtype, allow_nonfinite: bool = False
) -> torch.Tensor:
    """The k3train tensor of `spec` (the expert's slice for an expert spec) read from `hf`, in
    dtype `wanted`. The stored dtype must be one a cast keeps the meaning of
    (`check_imported_dtype`) and, unless `allow_nonfinite`, every value finite."""
    value = import_tensor(spec, hf.get(spec.hf_name))
    check_imported_dtype(spec.hf_name, value.dtype, wanted, hf.path)
    if not allow_nonfinite and value.is_floating_point():
        bad = int((~torch.isfinite(value)).sum())
        if bad:
            raise HFConversionError(
                f"{hf.path}: tensor {spec.hf_name} holds {bad:,} NaN or infinite value(s) of "
                f"{value.numel():,}; fix the weights, or pass --allow-nonfinite to import them anyway"
            )
    return value.to(wanted)


def load_hf_weights(
    model: torch.nn.Module,
    hf: HFDirectory,
    specs: Sequence[TensorSpec],
    progress: Callable[[int], None] | None = None,
    allow_nonfinite: bool = False,
) -> None:
    """Copy every spec's HF tensor into `model` (one tensor in memory at a time besides the
    model; `imported_value` checks each); every model tensor must be covered (a tied head
    through the embedding). `progress(1)` is called after each tensor."""
    state = model.state_dict()
    covered: set[str] = set()
    with torch.no_grad():
        for spec in specs:
            target = state[spec.k3_name]
            if spec.expert is not None:
                target = target[spec.expert]
            target.copy_(imported_value(hf, spec, target.dtype, allow_nonfinite))
            covered.add(spec.k3_name)
            if progress is not None:
                progress(1)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    uncovered = [n for n in state if n not in covered and n not in tied]
    if uncovered:
        raise HFConversionError(f"the HF tensors left model tensors unset: {short_listing(uncovered)}")
