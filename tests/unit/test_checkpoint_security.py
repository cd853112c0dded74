"""Hostile files: nothing k3train reads from a checkpoint or a Hugging Face directory runs code or
opens files outside its folder. Each test builds the hostile file, loads it the ways the job and
the tools do, and checks for one line (CheckpointError / exit status 2) and an absent marker file."""

from __future__ import annotations

import importlib.util
import json
import pickle
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from k3train.checkpoint import Checkpointer, CheckpointError, verify_checkpoint, write_manifest
from k3train.checkpoint.hf_io import CheckpointTensorReader, HFDirectory
from k3train.checkpoint.integrity import checksum_files
from k3train.checkpoint.safe_metadata import read_metadata_safely
from k3train.checkpoint.values import decode_value, encode_value

CHECKOUT = Path(__file__).resolve().parents[2]


def _load_tool(name: str):
    spec = importlib.util.spec_from_file_location(f"_tool_sec_{name}", CHECKOUT / "tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


class MarkerPayload:
    """Unpickling this creates `marker` (what a hostile file would do with a shell command)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


def _reseal(path: Path) -> None:
    """Rewrite the manifest's checksums over the tampered files, as an attacker would."""
    manifest = json.loads((path / "k3train.json").read_text())
    files = checksum_files(path, sorted(manifest["files"]))
    write_manifest(path, manifest["step"], keys=manifest["keys"], checksum="crc32", files=files)


def _good_checkpoint(root: Path) -> Path:
    model = nn.Linear(3, 2)
    return Checkpointer(root).save(5, {"model": model, "progress": {"step": 5}})


def test_the_payload_is_live():
    """Control: plain unpickling of the payload does create its marker (so the tests below mean something)."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        control = Path(d) / "control"
        pickle.loads(pickle.dumps(MarkerPayload(control)))
        assert control.exists()


def _assert_one_line(error: BaseException) -> None:
    assert "\n" not in str(error) and str(error)


@pytest.mark.parametrize("nested", [False, True])
def test_hostile_metadata_pickle_is_refused(tmp_path, nested):
    marker = tmp_path / "marker"
    path = _good_checkpoint(tmp_path / "ckpt")
    if nested:  # a real Metadata object with the payload hidden inside
        metadata = read_metadata_safely(path)
        metadata.planner_data = {"model.weight": ("model", MarkerPayload(marker))}
        payload = pickle.dumps(metadata)
    else:
        payload = pickle.dumps(MarkerPayload(marker))
    (path / ".metadata").write_bytes(payload)
    _reseal(path)

    for attempt in (
        lambda: read_metadata_safely(path),
        lambda: verify_checkpoint(path),
        lambda: Checkpointer(tmp_path / "ckpt").resolve_resume(str(path)),
        lambda: Checkpointer(tmp_path / "ckpt").load(path, {"model": nn.Linear(3, 2), "progress": {"step": 0}}),
    ):
        with pytest.raises(CheckpointError, match="refus") as info:
            attempt()
        _assert_one_line(info.value)
    from k3train.checkpoint.hf import HFConversionError

    with pytest.raises(HFConversionError, match="refus"):  # tools/convert_checkpoint.py to-hf
        CheckpointTensorReader(path)
    # resume=auto moves it aside and says there is nothing usable left.
    with pytest.raises(CheckpointError, match="no usable checkpoint"):
        Checkpointer(tmp_path / "ckpt").resolve_resume("auto")
    assert (tmp_path / "ckpt" / "step_00000005.damaged-metadata").is_dir()
    assert not marker.exists()


def test_pickled_value_in_a_shard_is_refused(tmp_path):
    marker = tmp_path / "marker"
    path = tmp_path / "ckpt" / "step_00000001"
    path.mkdir(parents=True)
    # What torch's default planner writes for a non-tensor value: a torch.save pickle.
    dcp.save(
        {"progress": MarkerPayload(marker), "w": torch.ones(2)},
        storage_writer=FileSystemWriter(str(path)),
        planner=DefaultSavePlanner(),
        no_dist=True,
    )
    names = [p.name for p in path.iterdir()]
    write_manifest(path, 1, keys=["progress", "w"], checksum="crc32", files=checksum_files(path, names))
    assert verify_checkpoint(path) is not None  # a well-formed checkpoint, apart from its value

    with pytest.raises(CheckpointError, match="pickle") as info:
        Checkpointer(tmp_path / "ckpt").load(path, {"progress": {"step": 0}, "w": torch.zeros(2)})
    _assert_one_line(info.value)
    assert not marker.exists()


def test_value_codec_round_trips_and_refuses_other_bytes():
    import numpy as np

    value = {
        "a": (1, 2.5, None, "x"),
        3: [True, b"\x00\xff"],
        "t": torch.arange(4, dtype=torch.int16),
        "np": np.arange(3, dtype=np.uint32),
        "s": np.float64(1.5),
        "dt": torch.bfloat16,
        "__k3__": "user key",
        "nan": float("inf"),
    }
    back = decode_value(encode_value(value))
    assert back["a"] == (1, 2.5, None, "x") and back[3] == [True, b"\x00\xff"] and back["dt"] is torch.bfloat16
    assert torch.equal(back["t"], value["t"]) and back["t"].dtype == torch.int16
    assert np.array_equal(back["np"], value["np"]) and back["np"].dtype == np.uint32
    assert back["s"] == 1.5 and back["__k3__"] == "user key" and back["nan"] == float("inf")
    with pytest.raises(CheckpointError, match="pickle"):
        decode_value(pickle.dumps({"a": 1}))
    with pytest.raises(CheckpointError, match="damaged"):
        decode_value(b"K3JSON1\n{not json")
    with pytest.raises(CheckpointError, match="cannot save"):
        encode_value({"f": lambda: 0})


# -- Hugging Face directories (tools/convert_checkpoint.py from-hf) ----------------------------------


def _hf_dir(root: Path, config: object = None, index: object = None, shard: bytes | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(
        json.dumps({} if config is None else config) if not isinstance(config, str) else config
    )
    if index is not None:
        (root / "model.safetensors.index.json").write_text(index if isinstance(index, str) else json.dumps(index))
    if shard is not None:
        (root / "model.safetensors").write_bytes(shard)
    elif index is None:
        save_file({"x": torch.zeros(2)}, str(root / "model.safetensors"))
    return root


@pytest.mark.parametrize(
    "name, build, expected",
    [
        (
            "traversal",
            lambda d: _hf_dir(d, index={"weight_map": {"x": "../../../../etc/passwd"}}),
            "not a file name inside",
        ),
        ("absolute", lambda d: _hf_dir(d, index={"weight_map": {"x": "/etc/passwd"}}), "not a file name inside"),
        ("link", None, "leads outside"),
        ("invalid index json", lambda d: _hf_dir(d, index="{nope"), "not valid JSON"),
        ("weight_map list", lambda d: _hf_dir(d, index={"weight_map": ["a"]}), "weight_map must be"),
        ("index not object", lambda d: _hf_dir(d, index="[1, 2]"), "must hold a JSON object"),
        ("invalid config json", lambda d: _hf_dir(d, config="{,}"), "not valid JSON"),
        ("bad safetensors header", lambda d: _hf_dir(d, shard=b"\xff" * 64), "not a valid safetensors file"),
        (
            "string for a number",
            lambda d: _hf_dir(d, config={"model_type": "kimi_linear", "mla_use_nope": True, "hidden_size": "abc"}),
            "hidden_size must be int",
        ),
    ],
)
def test_hostile_hf_directory_is_refused_in_one_line(tmp_path, capsys, name, build, expected):
    source = tmp_path / "hf"
    if build is None:  # a shard that is a symbolic link to a file outside the directory
        outside = tmp_path / "secret.safetensors"
        save_file({"x": torch.zeros(2)}, str(outside))
        _hf_dir(source, index={"weight_map": {"x": "model-1.safetensors"}})
        (source / "model-1.safetensors").symlink_to(outside)
    else:
        build(source)
    convert = _load_tool("convert_checkpoint")
    assert convert.main(["from-hf", "--load", str(source), "--out", str(tmp_path / "run"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and expected in err, err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_hf_directory_reads_shards_inside_its_folder(tmp_path):
    source = _hf_dir(tmp_path / "hf", index={"weight_map": {"x": "sub/model-1.safetensors"}})
    (source / "sub").mkdir()
    save_file({"x": torch.ones(2)}, str(source / "sub" / "model-1.safetensors"))
    assert torch.equal(HFDirectory(source).get("x"), torch.ones(2))
