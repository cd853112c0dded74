"""from-hf's checkpoint, written tensor by tensor: a model-only k3train checkpoint whose tensors
are read from a Hugging Face directory only as DCP writes them, so the import never holds the
model. Peak memory ≈ the checkpoint file being written (`max_file_bytes` of tensors, which DCP's
writer keeps until the file is closed), the HF shard being read and the largest single tensor.

A stack of routed experts (`[E, out, in]` in k3train, one tensor per expert on the hub) is saved
as E chunks along dim 0, one per hub tensor, as an expert-parallel run saves it; DCP reshards on
load, so the trainer (any layout) and `to-hf` read it as any other checkpoint.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from k3train.checkpoint.errors import CheckpointError
from k3train.checkpoint.hf import HFConversionError, TensorSpec, short_listing
from k3train.checkpoint.hf_io import HFDirectory, imported_value
from k3train.checkpoint.manifest import TMP_PREFIX, step_dir_name
from k3train.checkpoint.values import JsonSavePlanner
from k3train.checkpoint.writing import SaveJob, write_checkpoint
from k3train.model.config import ModelConfig

MODEL_KEY = "model"
"""The app-state key of the model (what `Checkpointer.save(step, {"model": model})` writes)."""


@dataclass
class ImportedTensor:
    """One tensor of the k3train state dict, read from the HF directory when DCP writes it:
    whole (one spec) or, for a stack of experts, one chunk per expert (one spec each)."""

    shape: tuple[int, ...]
    properties: TensorProperties
    specs: list[TensorSpec]
    """One spec (a whole tensor) or one per expert, in expert order."""
    read: Callable[[TensorSpec, torch.dtype], torch.Tensor] = field(repr=False)

    @property
    def stacked(self) -> bool:
        return self.specs[0].expert is not None

    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        """DCP's hook for objects that describe their own chunks (as DTensor does)."""
        if not self.stacked:
            offsets = torch.Size([0] * len(self.shape))
            chunks = [(offsets, torch.Size(self.shape), WriteItemType.TENSOR)]
        else:
            rest = [0] * (len(self.shape) - 1)
            chunks = [
                (torch.Size([expert, *rest]), torch.Size([1, *self.shape[1:]]), WriteItemType.SHARD)
                for expert in range(len(self.specs))  # imported_state orders the specs by expert
            ]
        return [
            WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=kind,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                    properties=self.properties,
                    size=torch.Size(self.shape),
                ),
            )
            for offsets, sizes, kind in chunks
        ]

    def chunk(self, offsets: Sequence[int]) -> torch.Tensor:
        """The tensor (or expert chunk `[1, out, in]` starting at `offsets`) as saved."""
        dtype = self.properties.dtype
        if not self.stacked:
            return self.read(self.specs[0], dtype).contiguous()
        return self.read(self.specs[int(offsets[0])], dtype).unsqueeze(0).contiguous()


class ImportSavePlanner(JsonSavePlanner):
    """k3train's save planner, resolving `ImportedTensor` entries by reading them. The first
    `HFConversionError` a read raises is kept (`failure`): DCP turns it into a save failure,
    from-hf reports it as the one line it is."""

    def __init__(self, progress: Callable[[int], object] | None = None) -> None:
        super().__init__()
        self.failure: HFConversionError | None = None
        self.progress = progress
        """Called with the bytes of each tensor (chunk) read."""

    def resolve_data(self, write_item: WriteItem):
        entry = self.state_dict.get(write_item.index.fqn)
        if not isinstance(entry, ImportedTensor):
            return super().resolve_data(write_item)
        assert write_item.tensor_data is not None, "an ImportedTensor's write items are tensor items"
        try:
            value = entry.chunk(write_item.tensor_data.chunk.offsets)
        except HFConversionError as error:
            self.failure = self.failure or error
            raise
        if self.progress is not None:
            self.progress(value.numel() * value.element_size())
        return value


def imported_state(
    config: ModelConfig, hf: HFDirectory, specs: Sequence[TensorSpec], allow_nonfinite: bool = False
) -> dict[str, ImportedTensor]:
    """Every tensor of `K3ModelChunk(config).state_dict()` (the model built on the meta device:
    nothing allocated) as an `ImportedTensor` over `specs`; a tied head reads the embedding."""
    from k3train.model.k3 import K3ModelChunk

    with torch.device("meta"):
        model = K3ModelChunk(config)
    by_name: dict[str, list[TensorSpec]] = {}
    for spec in specs:
        by_name.setdefault(spec.k3_name, []).append(spec)
    if config.tie_word_embeddings and "embed_tokens.weight" in by_name:
        by_name.setdefault("lm_head.weight", by_name["embed_tokens.weight"])
    state = model.state_dict()
    uncovered = [name for name in state if name not in by_name]
    if uncovered:
        raise HFConversionError(f"the HF tensors leave model tensors unset: {short_listing(uncovered)}")

    def read(spec: TensorSpec, dtype: torch.dtype) -> torch.Tensor:
        return imported_value(hf, spec, dtype, allow_nonfinite)

    out = {}
    for name, tensor in state.items():
        group = sorted(by_name[name], key=lambda s: -1 if s.expert is None else s.expert)
        if group[0].expert is not None and [s.expert for s in group] != list(range(tensor.shape[0])):
            raise HFConversionError(f"the HF tensors of {name} do not cover its {tensor.shape[0]} experts once each")
        properties = TensorProperties(dtype=tensor.dtype, requires_grad=tensor.requires_grad)
        out[name] = ImportedTensor(tuple(tensor.shape), properties, group, read)
    return out


def write_imported_checkpoint(
    directory: Path,
    step: int,
    state: dict[str, ImportedTensor],
    max_file_bytes: int,
    progress: Callable[[int], object] | None = None,
) -> Path:
    """Write `state` as the model-only checkpoint `directory/step_NNNNNNNN` (atomic, with the
    manifest and checksums, as `Checkpointer.save` writes it); return its path. A read that
    fails raises its `HFConversionError` (one line) and leaves no checkpoint behind. `progress`
    is called with the bytes of each tensor read."""
    final = directory / step_dir_name(step)
    tmp = directory / f"{TMP_PREFIX}{final.name}_{secrets.token_hex(4)}"
    tmp.mkdir(parents=True)
    planner = ImportSavePlanner(progress)
    job = SaveJob(
        step=step,
        tmp=tmp,
        final=final,
        state={MODEL_KEY: state},
        keys=[MODEL_KEY],
        kept=lambda: f"nothing was written to {directory}",
        finished=lambda path: None,
        planner=planner,
        max_file_bytes=max_file_bytes,
    )
    try:
        return write_checkpoint(job, None)
    except CheckpointError:
        if planner.failure is not None:
            raise planner.failure from None
        raise
