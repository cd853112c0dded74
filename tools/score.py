#!/usr/bin/env python
"""Logits of k3train's own model for given token ids, from a k3train checkpoint or an HF directory.

    python tools/score.py --load RUN_DIR/checkpoints/step_00001000 --tokens-file tokens.json --out a.json
    python tools/score.py --load hf_export/ --tokens-file tokens.json --out b.json [--dtype fp64]

`tokens.json` holds a list of token-id lists of equal length (a batch). `OUT.json` is
`{"logits_shape": [B, T, V], "logits": [[[...]]]}` with float32 values, computed in eval mode by
`K3ModelChunk` in float32 (or float64 with `--dtype fp64`, then rounded to float32 for the file).

A k3train checkpoint is read with the trainer's own `Checkpointer` (config: `--config`, else the
run's `config.yaml` two directories up); an HF directory (config.json + safetensors) through the
mapping of `k3train/checkpoint/hf.py`. Scoring both sides of a conversion and comparing the files
checks the conversion end to end.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
from collections.abc import Sequence

from k3train.path_arguments import PathArgument, exit_if_a_path_is_missing

PATH_ARGUMENTS = (
    PathArgument(
        "--load",
        "pass a k3train checkpoint (a step_NNNNNNNN, checkpoints/ or run directory) "
        "or a Hugging Face directory (config.json + safetensors)",
    ),
    PathArgument("--tokens-file", "pass a JSON file holding a list of equal-length token-id lists"),
    PathArgument("--config", "pass the run's config.yaml, or leave --config out to use RUN_DIR/config.yaml"),
)
if __name__ == "__main__":  # before torch loads (seconds; far more on a cold disk): a wrong path answers at once
    exit_if_a_path_is_missing(sys.argv[1:], PATH_ARGUMENTS)

import torch  # noqa: E402

from k3train.checkpoint import Checkpointer, CheckpointError  # noqa: E402
from k3train.checkpoint.bounded_json import json_file  # noqa: E402
from k3train.checkpoint.hf import (  # noqa: E402
    HFConversionError,
    bind_stored_names,
    check_hf_tensors,
    hf_tensor_specs,
)
from k3train.checkpoint.hf_config import from_hf_config, hub_layout  # noqa: E402
from k3train.checkpoint.hf_io import (  # noqa: E402
    HFDirectory,
    build_empty_model,
    find_checkpoint,
    load_hf_weights,
    run_config_path,
)
from k3train.config import ConfigError, load_config  # noqa: E402
from k3train.model.k3 import K3ModelChunk  # noqa: E402

DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


def load_model(path: str, config: str | None = None) -> tuple[K3ModelChunk, str]:
    """(K3ModelChunk with the weights of `path`, a description of where they came from)."""
    if HFDirectory.is_hf_dir(path):
        hf = HFDirectory(path)
        model_config = from_hf_config(hf.config, source=str(hf.path / "config.json"))
        layout = hub_layout(hf.config)
        specs = bind_stored_names(hf.shapes(), hf_tensor_specs(model_config, layout=layout))
        check_hf_tensors(hf.shapes(), specs, source=str(hf.path), layout=layout)
        model = build_empty_model(model_config)
        load_hf_weights(model, hf, specs)
        return model, f"HF directory {hf.path}"
    checkpoint = find_checkpoint(path)
    config_path = run_config_path(checkpoint, config)
    model = build_empty_model(load_config(str(config_path), []).model)
    # Checkpointer(dir) cleans stale saves in `dir` on start-up; point it at a scratch directory so
    # scoring never touches the run's checkpoint directory (a training job may be saving there).
    with tempfile.TemporaryDirectory() as scratch:
        Checkpointer(scratch).load(checkpoint, {"model": model})
    return model, f"k3train checkpoint {checkpoint} (config {config_path})"


TOKENS_FILE_MAX_BYTES = 1 << 30


def read_tokens(path: str, vocab_size: int) -> torch.Tensor:
    try:
        data = json_file(path, TOKENS_FILE_MAX_BYTES)
    except (OSError, ValueError) as error:  # too large or nested too deep included
        raise HFConversionError(f"--tokens-file {path}: {error}") from None
    if (
        not isinstance(data, list)
        or not data
        or not all(isinstance(row, list) and row for row in data)
        or not all(isinstance(t, int) and not isinstance(t, bool) for row in data for t in row)
    ):
        raise HFConversionError(f"--tokens-file {path} must hold a non-empty list of non-empty lists of token ids")
    if len({len(row) for row in data}) != 1:
        raise HFConversionError(
            f"--tokens-file {path}: the token lists differ in length ({sorted({len(r) for r in data})})"
        )
    tokens = torch.tensor(data, dtype=torch.long)
    if tokens.min() < 0 or tokens.max() >= vocab_size:
        raise HFConversionError(
            f"--tokens-file {path}: ids must lie in [0, {vocab_size}), got {tokens.min()}..{tokens.max()}"
        )
    return tokens


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="score.py", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--load", required=True, help="k3train checkpoint (step dir, checkpoints/ or run dir) or HF directory"
    )
    parser.add_argument("--tokens-file", required=True, help="JSON list of equal-length token-id lists")
    parser.add_argument("--out", required=True, help="output JSON: logits_shape and logits")
    parser.add_argument("--config", default=None, help="config.yaml of a k3train checkpoint (default: the run's)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="compute dtype (default fp32)")
    args = parser.parse_args(argv)
    try:
        model, source = load_model(args.load, args.config)
        tokens = read_tokens(args.tokens_file, model.config.vocab_size)
    except (HFConversionError, CheckpointError, ConfigError) as error:
        print(f"error: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
    model = model.to(DTYPES[args.dtype]).eval()
    with torch.no_grad():
        logits = model(tokens).to(torch.float32)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"logits_shape": list(logits.shape), "logits": logits.tolist()}), encoding="utf-8")
    print(f"scored {tuple(tokens.shape)} tokens with {source} in {args.dtype}: logits {tuple(logits.shape)} → {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
