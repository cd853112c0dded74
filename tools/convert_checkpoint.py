#!/usr/bin/env python
"""Convert k3train checkpoints to and from the Kimi K3 / Kimi Linear Hugging Face hub formats.

    python tools/convert_checkpoint.py to-hf --load RUN_DIR/checkpoints/step_00001000 --out hf/ \\
        [--config RUN_DIR/config.yaml] [--format kimi_k3|kimi_linear] [--dtype bf16|fp32] [--max-shard-size 5GB]
    python tools/convert_checkpoint.py from-hf --load hf/ --out RUN_DIR [--recipe recipes/k3.yaml]

to-hf writes `config.json` (from the run's model config), `model-0000x-of-0000y.safetensors`
shards and `model.safetensors.index.json`. It streams: model tensors are read from the DCP
checkpoint a few at a time (routed experts in slabs of experts), whatever parallel layout saved
them, and written straight into the shard files, so a model larger than memory converts. The
names, shapes, file order and config fields are described in docs/hf_conversion.md.

from-hf writes a run directory that `pretrain_k3.py --run-dir RUN_DIR` starts from:
`RUN_DIR/config.yaml` (the model section from config.json, everything else from --recipe or the
defaults) and `RUN_DIR/checkpoints/step_00000000/` holding the model only (no optimizer state).
The layout (K3's or a bare Kimi Linear's, e.g. saved by transformers) is read from config.json.
Configurations k3train cannot represent (rotary MLA, grouped top-k, quantised experts) are
refused with one line naming the problem.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import re
import shutil
import struct
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import BinaryIO

from k3train.path_arguments import PathArgument, exit_if_a_path_is_missing

CHECKOUT = pathlib.Path(__file__).resolve().parents[1]

PATH_ARGUMENTS = (
    PathArgument(
        "--load",
        "pass a checkpoint (RUN_DIR/checkpoints/step_NNNNNNNN), a checkpoints/ directory or a run directory",
        subcommand="to-hf",
    ),
    PathArgument(
        "--config", "pass the run's config.yaml, or leave --config out to use RUN_DIR/config.yaml", subcommand="to-hf"
    ),
    PathArgument(
        "--load",
        "pass a Hugging Face model directory (config.json + safetensors)",
        subcommand="from-hf",
        contains="config.json",
    ),
    PathArgument(
        "--recipe",
        "pass a recipe YAML (e.g. recipes/k3.yaml), or leave --recipe out for the defaults",
        subcommand="from-hf",
    ),
)
if __name__ == "__main__":  # before torch loads (seconds; far more on a cold disk): a wrong path answers at once
    exit_if_a_path_is_missing(sys.argv[1:], PATH_ARGUMENTS)

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from k3train.checkpoint import Checkpointer, CheckpointError  # noqa: E402
from k3train.checkpoint.errors import describe_save_failure  # noqa: E402
from k3train.checkpoint.hf import (  # noqa: E402
    HUB_LAYOUTS,
    HFConversionError,
    TensorSpec,
    bind_stored_names,
    check_hf_tensors,
    export_tensor,
    hf_tensor_specs,
    k3_state_shapes,
)
from k3train.checkpoint.hf_config import (  # noqa: E402
    declared_special_tokens,
    from_hf_config,
    hub_layout,
    to_hf_config,
    to_kimi_linear_config,
    with_special_tokens,
)
from k3train.checkpoint.hf_import import imported_state, write_imported_checkpoint  # noqa: E402
from k3train.checkpoint.hf_io import (  # noqa: E402
    CheckpointTensorReader,
    HFDirectory,
    find_checkpoint,
    run_config_path,
)
from k3train.checkpoint.hf_tokenizer import export_tokenizer, generation_config, import_tokenizer  # noqa: E402
from k3train.config import ConfigError, JobConfig, load_config, save_config  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
REMOTE_CODE_DIR = CHECKOUT / "k3train" / "checkpoint" / "hf_remote"
REMOTE_CODE_FILES = ("cache_kimi_k3.py", "configuration_kimi_k3.py", "kda_kimi_k3.py", "modeling_kimi_k3.py")
REMOTE_CODE_AUTO_MAP = {
    "AutoConfig": "configuration_kimi_k3.KimiK3Config",
    "AutoModelForCausalLM": "modeling_kimi_k3.KimiK3ForCausalLM",
}
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}
INDEX_NAME = "model.safetensors.index.json"
_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(text: str) -> int:
    """'5GB' → 5_000_000_000 (KB/MB/GB/TB decimal as in transformers; KiB/MiB/GiB binary)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).upper() if match else None
    if not match or unit not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"size {text!r}: expected a number with B, KB, MB, GB, TB, KiB, MiB or GiB")
    size = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if size <= 0:
        raise argparse.ArgumentTypeError(f"size {text!r} must be positive")
    return size


# ============================================================================ safetensors shards


def plan_shards(specs: Sequence[TensorSpec], dtype: torch.dtype, max_bytes: int) -> list[list[TensorSpec]]:
    """Consecutive groups of at most `max_bytes` of tensor data (a larger tensor gets its own
    shard), as transformers' `save_pretrained(max_shard_size=…)` splits."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        nbytes = spec.nbytes(dtype)
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards


def shard_file_name(index: int, count: int) -> str:
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


class ShardWriter:
    """Writes the planned shards tensor by tensor, in plan order: each shard's safetensors header
    (names, dtypes, shapes, offsets) is known from the plan, so it is written first and every
    tensor's bytes follow as they arrive; nothing is buffered. Files appear under their final
    names only when complete (`.part` until then)."""

    def __init__(self, out: pathlib.Path, shards: list[list[TensorSpec]], dtype: torch.dtype) -> None:
        self.out, self.shards, self.dtype = out, shards, dtype
        self.names = [shard_file_name(i, len(shards)) for i in range(len(shards))]
        self._queue: Iterator[tuple[int, TensorSpec]] = ((i, s) for i, shard in enumerate(shards) for s in shard)
        self._shard = -1
        self._file: BinaryIO | None = None
        self._remaining = 0

    def _open(self, index: int) -> None:
        self._close()
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for spec in self.shards[index]:
            nbytes = spec.nbytes(self.dtype)
            header[spec.hf_name] = {
                "dtype": SAFETENSORS_DTYPES[spec.export_dtype(self.dtype)],
                "shape": list(spec.shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
        text = json.dumps(header, separators=(",", ":")).encode("utf-8")
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
        self._shard = index
        self._file = open(self.out / (self.names[index] + ".part"), "wb")
        self._file.write(struct.pack("<Q", len(text)))
        self._file.write(text)
        self._remaining = len(self.shards[index])

    def _close(self) -> None:
        if self._file is None:
            return
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._file = None
        name = self.names[self._shard]
        os.replace(self.out / (name + ".part"), self.out / name)

    def write(self, spec: TensorSpec, tensor: torch.Tensor) -> None:
        index, expected = next(self._queue)
        if spec != expected:
            raise RuntimeError(f"tensors out of plan order: got {spec.hf_name}, expected {expected.hf_name}")
        if index != self._shard:
            self._open(index)
        want_dtype = spec.export_dtype(self.dtype)
        if tensor.dtype != want_dtype or tuple(tensor.shape) != spec.shape:
            raise RuntimeError(
                f"{spec.hf_name}: {tensor.dtype} {tuple(tensor.shape)}, planned {want_dtype} {spec.shape}"
            )
        if tensor.numel():
            assert self._file is not None, "the shard this tensor belongs to is open until its last tensor"
            self._file.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)
        self._remaining -= 1
        if self._remaining == 0:
            self._close()

    def abandon(self) -> None:
        """Close the shard being written without renaming it (its `.part` is the caller's to remove)."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def finish(self) -> dict[str, str]:
        """Close the last shard; the index's weight map."""
        leftover = next(self._queue, None)
        if leftover is not None:
            raise RuntimeError(f"conversion ended before {leftover[1].hf_name} was written")
        self._close()
        return {spec.hf_name: self.names[i] for i, shard in enumerate(self.shards) for spec in shard}


# ============================================================================ reading the checkpoint


@dataclass
class ReadUnit:
    """Specs served by one group of reads: whole tensors, or a slab of experts [start, end)."""

    requests: list[tuple[str, tuple[int, int] | None]]
    specs: Sequence[TensorSpec]
    start: int = 0
    nbytes: int = 0


def expert_slabs(num_experts: int, cuts: Sequence[int], per_expert_bytes: int, budget: int) -> list[tuple[int, int]]:
    """Expert ranges to read at once: never across a saved chunk boundary in `cuts` unless merging
    whole pieces (each saved chunk is then read once), at most `budget` bytes each (at least one
    expert)."""
    most = max(1, budget // max(per_expert_bytes, 1))
    pieces = []
    cuts = sorted(set(cuts) | {0, num_experts})
    for a, b in zip(cuts, cuts[1:]):
        for start in range(a, b, most):
            pieces.append((start, min(b, start + most)))
    merged: list[tuple[int, int]] = []
    for a, b in pieces:
        if merged and b - merged[-1][0] <= most:
            merged[-1] = (merged[-1][0], b)
        else:
            merged.append((a, b))
    return merged


def read_units(specs: Sequence[TensorSpec], reader: CheckpointTensorReader, budget: int) -> Iterator[ReadUnit]:
    i = 0
    while i < len(specs):
        spec = specs[i]
        if spec.expert is None:
            nbytes = spec.numel * reader.dtype(spec.k3_name).itemsize
            yield ReadUnit([(spec.k3_name, None)], [spec], 0, nbytes)
            i += 1
            continue
        layer_stack = spec.k3_name.rsplit(".", 1)[0]
        j = i
        while j < len(specs) and specs[j].expert is not None and specs[j].k3_name.rsplit(".", 1)[0] == layer_stack:
            j += 1
        group = specs[i:j]
        names = list(dict.fromkeys(s.k3_name for s in group))
        num_experts = group[0].k3_shape[0]
        per_expert = sum(s.numel * reader.dtype(s.k3_name).itemsize for s in group[: len(names)])  # expert 0
        cuts = sorted({c for name in names for c in reader.dim0_boundaries(name)})
        width = len(names)  # the group lists expert 0's tensors, then expert 1's, ...
        assert len(group) == num_experts * width and all(s.expert == k // width for k, s in enumerate(group))
        for a, b in expert_slabs(num_experts, cuts, per_expert, budget):
            yield ReadUnit([(name, (a, b)) for name in names], group[a * width : b * width], a, per_expert * (b - a))
        i = j


def batched_reads(units: Iterator[ReadUnit], budget: int) -> Iterator[list[ReadUnit]]:
    """Units grouped into one `dcp.load` each: at most `budget` bytes, each tensor once per call."""
    batch: list[ReadUnit] = []
    size = 0
    names: set[str] = set()
    for unit in units:
        unit_names = {name for name, _ in unit.requests}
        if batch and (size + unit.nbytes > budget or unit_names & names):
            yield batch
            batch, size, names = [], 0, set()
        batch.append(unit)
        size += unit.nbytes
        names |= unit_names
    if batch:
        yield batch


# ============================================================================ to-hf


def _prepare_out(out: pathlib.Path, overwrite: bool, markers: Sequence[str]) -> None:
    if out.exists() and not out.is_dir():
        raise HFConversionError(f"--out {out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    existing = [p.name for p in sorted(out.iterdir()) if any(p.match(m) for m in markers)]
    if existing and not overwrite:
        raise HFConversionError(
            f"--out {out} already holds {', '.join(existing[:3])}{' ...' if len(existing) > 3 else ''}; "
            "pass --overwrite or choose an empty directory"
        )


def to_hf(args: argparse.Namespace) -> int:
    checkpoint = find_checkpoint(args.load)
    config_path = run_config_path(checkpoint, args.config)
    job = load_config(str(config_path), [])
    model_config = job.model
    dtype = DTYPES[args.dtype]
    a_log_width = model_config.linear_attn_config.head_dim if args.pad_a_log else None
    if a_log_width is not None and a_log_width < model_config.linear_attn_config.num_heads:
        a_log_width = model_config.linear_attn_config.num_heads
    layout = HUB_LAYOUTS[args.format]
    if layout.name == "kimi_linear":
        if args.pad_a_log:
            raise HFConversionError(
                "--pad-a-log applies to --format kimi_k3 only (Kimi Linear stores A_log [1, 1, H, 1])"
            )
        hf_config = to_kimi_linear_config(
            model_config, dtype=dtype, max_position_embeddings=args.max_position_embeddings
        )
    else:
        hf_config = to_hf_config(
            model_config,
            dtype=dtype,
            max_position_embeddings=args.max_position_embeddings,
            allow_k3train_only=args.allow_k3train_only,
            a_log_width=a_log_width,
        )
    specs = hf_tensor_specs(model_config, a_log_width=a_log_width, layout=layout)
    reader = CheckpointTensorReader(checkpoint)
    reader.check_names(k3_state_shapes(model_config))

    out = pathlib.Path(args.out)
    _prepare_out(out, args.overwrite, ["*.safetensors", INDEX_NAME, "config.json", "tokenizer*.json"])
    for stale in out.glob("model-*.safetensors*"):
        stale.unlink()
    shards = plan_shards(specs, dtype, args.max_shard_size)
    writer = ShardWriter(out, shards, dtype)
    total = sum(spec.nbytes(dtype) for spec in specs)
    print(
        f"to-hf: {checkpoint} (config {config_path}) → {out}: {len(specs):,} tensors, "
        f"{total / 1e9:.3f} GB {args.dtype}, {len(shards)} shard(s)"
    )
    try:
        with tqdm(total=total, unit="B", unit_scale=True, desc="to-hf", disable=args.quiet) as bar:
            for batch in batched_reads(read_units(specs, reader, args.read_budget), args.read_budget):
                tensors = reader.read([request for unit in batch for request in unit.requests])
                position = 0
                for unit in batch:
                    loaded = dict(
                        zip((name for name, _ in unit.requests), tensors[position : position + len(unit.requests)])
                    )
                    position += len(unit.requests)
                    for spec in unit.specs:
                        value = loaded[spec.k3_name]
                        if spec.expert is not None:
                            value = value[spec.expert - unit.start]
                        writer.write(spec, export_tensor(spec, value, dtype))
                        bar.update(spec.nbytes(dtype))
                    loaded.clear()
                del tensors
        weight_map = writer.finish()
        _write_json(out / INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": weight_map})
        if layout.name == "kimi_k3":  # the model's own code, for AutoModelForCausalLM(..., trust_remote_code=True)
            for name in REMOTE_CODE_FILES:
                shutil.copyfile(REMOTE_CODE_DIR / name, out / name)
            hf_config = dict(hf_config, auto_map=dict(REMOTE_CODE_AUTO_MAP))
        tokenizer = export_tokenizer(job.data.tokenizer, job.data.eos_token, config_path.parent, out)
        hf_config = with_special_tokens(hf_config, tokenizer.ids, model_config.vocab_size)
        _write_json(out / "generation_config.json", generation_config(tokenizer.ids.within(model_config.vocab_size)))
        _write_json(out / "config.json", hf_config)
    except OSError as error:  # a full disk, a removed directory: no half-written file is left
        writer.abandon()
        for part in out.glob("*.part"):
            part.unlink(missing_ok=True)
        raise HFConversionError(f"to-hf: writing {out} failed: {describe_save_failure(error, out, total)}") from None
    print(f"wrote {out / 'config.json'}, {INDEX_NAME}, {len(shards)} shard(s) and {tokenizer.description}")
    return 0


def _write_json(path: pathlib.Path, value: dict) -> None:
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


# ============================================================================ from-hf


def from_hf(args: argparse.Namespace) -> int:
    hf = HFDirectory(args.load)
    model_config = from_hf_config(hf.config, source=str(hf.path / "config.json"))
    layout = hub_layout(hf.config)
    specs = bind_stored_names(hf.shapes(), hf_tensor_specs(model_config, layout=layout))
    ignored = check_hf_tensors(hf.shapes(), specs, source=str(hf.path), layout=layout)
    if ignored:
        print(
            f"from-hf: ignoring {len(ignored)} tensor(s) outside {layout.namespace} (e.g. {ignored[0]}): "
            "k3train converts the text model only"
        )

    out = pathlib.Path(args.out)
    _prepare_out(out, args.overwrite, ["config.yaml", "checkpoints"])
    job = load_config(args.recipe, []) if args.recipe else JobConfig()
    job.model = model_config
    tokenizer = import_tokenizer(hf.path, declared_special_tokens(hf.config, str(hf.path / "config.json")), out)
    job.data.tokenizer = tokenizer.data_tokenizer
    if tokenizer.eos_token is not None:
        job.data.eos_token = tokenizer.eos_token
    print(f"from-hf: tokenizer: {tokenizer.description}")
    job.checkpoint.dir = None  # RUN_DIR/checkpoints, where the converted step is
    job.checkpoint.resume = "auto"
    job.validate()

    state = imported_state(model_config, hf, specs, allow_nonfinite=args.allow_nonfinite)
    total = sum(spec.numel for spec in specs)
    print(f"from-hf: {hf.path} → {out}: {len(specs):,} tensors, {total / 1e6:.2f}M values")
    save_config(job, str(out / "config.yaml"))
    if (out / "checkpoints").exists() and args.overwrite:
        shutil.rmtree(out / "checkpoints")
    Checkpointer(out / "checkpoints", keep_last=0)  # creates the directory and clears stale saves
    # Streams: each tensor is read from the HF files only as DCP writes it (hf_import.py).
    nbytes = sum(math.prod(t.shape) * t.properties.dtype.itemsize for t in state.values())
    with tqdm(total=nbytes, unit="B", unit_scale=True, desc="from-hf", disable=args.quiet) as bar:
        path = write_imported_checkpoint(out / "checkpoints", 0, state, args.max_file_size, progress=bar.update)
    print(f"wrote {out / 'config.yaml'} and the model-only checkpoint {path}")
    return 0


# ============================================================================ command line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="convert_checkpoint.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("to-hf", help="k3train checkpoint → Hugging Face directory")
    p.add_argument(
        "--load",
        required=True,
        help="checkpoint: a step_NNNNNNNN directory, a checkpoints/ directory or a run directory (newest step)",
    )
    p.add_argument("--out", required=True, help="output directory (config.json, shards, index)")
    p.add_argument(
        "--config",
        default=None,
        help="the run's config.yaml (default: CHECKPOINT/../../config.yaml, where pretrain_k3.py writes it)",
    )
    p.add_argument(
        "--format",
        choices=sorted(HUB_LAYOUTS),
        default="kimi_k3",
        help="kimi_k3 (default: the K3 hub layout) or kimi_linear (transformers' KimiLinearForCausalLM, "
        "no remote code; refused with the feature named when the model is not expressible)",
    )
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="bf16",
        help="weight dtype (default bf16; A_log, dt_bias, conv weights and the routing bias stay fp32)",
    )
    p.add_argument(
        "--max-shard-size",
        type=parse_size,
        default=parse_size("5GB"),
        help="largest shard, e.g. 5GB (default), 500MB, 2GiB",
    )
    p.add_argument(
        "--pad-a-log",
        action="store_true",
        help="write A_log as [head_dim] with zero padding, like the published checkpoint (default [num_heads])",
    )
    p.add_argument(
        "--max-position-embeddings",
        type=int,
        default=1048576,
        help="config.json's max_position_embeddings (K3 has no position embeddings; default the published 1048576)",
    )
    p.add_argument(
        "--allow-k3train-only",
        action="store_true",
        help="no longer needed (kept for old scripts): the bundled remote code runs every model.attn_res mode",
    )
    p.add_argument(
        "--read-budget",
        type=parse_size,
        default=parse_size("2GB"),
        help="bytes read from the checkpoint per DCP load call (default 2GB)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing export in --out")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=to_hf)

    p = sub.add_parser("from-hf", help="Hugging Face directory → k3train run directory with a model-only checkpoint")
    p.add_argument("--load", required=True, help="Hugging Face directory (config.json + safetensors)")
    p.add_argument("--out", required=True, help="run directory to create: config.yaml + checkpoints/step_00000000")
    p.add_argument(
        "--recipe", default=None, help="recipe for everything but the model section (default: k3train's defaults)"
    )
    p.add_argument(
        "--allow-nonfinite",
        action="store_true",
        help="import tensors holding NaN or Inf values (refused by default: training would stop on them)",
    )
    p.add_argument(
        "--max-file-size",
        type=parse_size,
        default=parse_size("1GB"),
        help="largest file of the k3train checkpoint written (default 1GB): the import holds about one such "
        "file, the HF shard it reads and the largest tensor in memory",
    )
    p.add_argument("--overwrite", action="store_true", help="replace config.yaml and checkpoints/ in --out")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=from_hf)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (HFConversionError, CheckpointError, ConfigError) as error:
        print(f"error: {' '.join(str(error).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
