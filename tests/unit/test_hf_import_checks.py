"""What a Hugging Face folder hands in is checked before it is trained: each path stays inside
the folder (links included), each tensor's dtype keeps its meaning under the copy, its values are
finite (or `--allow-nonfinite`), and its JSON is bounded. Each refusal is one line."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from k3train.checkpoint.hf import HFConversionError, hf_tensor_specs
from k3train.checkpoint.hf_config import to_hf_config
from k3train.checkpoint.hf_io import HFDirectory, build_empty_model, load_hf_weights
from k3train.model.config import LinearAttnConfig, ModelConfig

CHECKOUT = Path(__file__).resolve().parents[2]
TINY = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=8,
    linear_attn_config=LinearAttnConfig(num_heads=2, head_dim=8),
    intermediate_size=32,
    num_experts=4,
    num_experts_per_token=2,
    moe_intermediate_size=16,
    routed_expert_hidden_size=16,
    attn_res_block_size=1,
)


def tiny_hf_dir(root: Path, change: dict[str, torch.Tensor] | None = None) -> Path:
    """A complete folder for TINY (zeros; `change` replaces named tensors)."""
    root.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for spec in hf_tensor_specs(TINY):
        shape = spec.k3_shape[1:] if spec.expert is not None else spec.k3_shape
        tensors[spec.hf_name] = torch.zeros(shape)
    for name, value in (change or {}).items():
        tensors[name if name in tensors else next(n for n in tensors if n.endswith(name))] = value
    save_file(tensors, str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps(to_hf_config(TINY)))
    return root


def load(root: Path, allow_nonfinite: bool = False) -> None:
    hf = HFDirectory(root)
    model = build_empty_model(TINY)
    load_hf_weights(model, hf, hf_tensor_specs(TINY), allow_nonfinite=allow_nonfinite)


def first_matrix_name() -> str:
    return next(s.hf_name for s in hf_tensor_specs(TINY) if len(s.k3_shape) == 2)


def test_a_clean_folder_loads(tmp_path):
    load(tiny_hf_dir(tmp_path / "hf"))


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool])
def test_a_float_parameter_stored_as_integers_or_bools_is_refused(tmp_path, dtype):
    name = first_matrix_name()
    shape = next(s.k3_shape for s in hf_tensor_specs(TINY) if s.hf_name == name)
    folder = tiny_hf_dir(tmp_path / "hf", {name: torch.zeros(shape, dtype=dtype)})
    with pytest.raises(HFConversionError, match=rf"{name} is stored as {str(dtype)[6:]}.*cast would change"):
        load(folder)


def test_nan_or_inf_weights_are_refused_unless_allowed(tmp_path):
    name = first_matrix_name()
    shape = next(s.k3_shape for s in hf_tensor_specs(TINY) if s.hf_name == name)
    bad = torch.zeros(shape)
    bad[0, 0], bad[0, 1] = float("nan"), float("inf")
    folder = tiny_hf_dir(tmp_path / "hf", {name: bad})
    with pytest.raises(HFConversionError, match=rf"{name} holds 2 NaN or infinite value.*--allow-nonfinite"):
        load(folder)
    load(folder, allow_nonfinite=True)


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "model.safetensors.index.json"])
def test_a_file_linked_out_of_the_folder_is_refused(tmp_path, name):
    folder = tiny_hf_dir(tmp_path / "hf")
    outside = tmp_path / "outside"
    outside.mkdir()
    if name == "model.safetensors.index.json":
        (outside / name).write_text(json.dumps({"weight_map": {"x": "model.safetensors"}}))
    else:
        (folder / name).rename(outside / name)
    (folder / name).symlink_to(outside / name)
    with pytest.raises(HFConversionError, match=f"{name} leads outside .*copy the file into the folder"):
        HFDirectory(folder)


def test_the_hub_cache_layout_may_link_into_its_blobs(tmp_path):
    """huggingface_hub keeps snapshots/<rev>/<name> as links to ../../blobs/<hash>."""
    repo = tmp_path / "models--k3--tiny"
    snapshot = tiny_hf_dir(repo / "snapshots" / "abc123")
    (repo / "blobs").mkdir()
    for name in ("model.safetensors", "config.json"):
        (snapshot / name).rename(repo / "blobs" / f"hash-{name}")
        (snapshot / name).symlink_to(Path("../../blobs") / f"hash-{name}")
    load(snapshot)


def _convert():
    spec = importlib.util.spec_from_file_location("_tool_hf_checks", CHECKOUT / "tools" / "convert_checkpoint.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_from_hf_refuses_a_tokenizer_linked_out_of_the_folder(tmp_path, capsys):
    folder = tiny_hf_dir(tmp_path / "hf")
    (tmp_path / "tokenizer.json").write_text("{}")
    (folder / "tokenizer.json").symlink_to(tmp_path / "tokenizer.json")
    assert _convert().main(["from-hf", "--load", str(folder), "--out", str(tmp_path / "run"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "tokenizer.json leads outside" in err, err
    assert not (tmp_path / "run" / "config.yaml").exists()


def _from_hf_error(tmp_path, capsys, folder: Path) -> str:
    assert _convert().main(["from-hf", "--load", str(folder), "--out", str(tmp_path / "run"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    return err


def test_a_negative_head_count_in_config_json_is_one_line(tmp_path, capsys):
    folder = tiny_hf_dir(tmp_path / "hf")
    config = json.loads((folder / "config.json").read_text())
    config.get("text_config", config)["num_attention_heads"] = -4
    (folder / "config.json").write_text(json.dumps(config))
    assert "num_attention_heads must be at least 1, got -4" in _from_hf_error(tmp_path, capsys, folder)


def test_a_deeply_nested_config_json_is_one_line(tmp_path, capsys):
    folder = tiny_hf_dir(tmp_path / "hf")
    raw = (folder / "config.json").read_text().rstrip()
    (folder / "config.json").write_text(raw[:-1] + ', "deep": ' + "[" * 100_000 + "]" * 100_000 + "}")
    assert "nested deeper" in _from_hf_error(tmp_path, capsys, folder)


# -- to-hf: what it reads from a checkpoint and what a failed write leaves -------------------------


@pytest.fixture
def converted_run(tmp_path) -> Path:
    """A k3train run directory made by from-hf of the tiny folder (a model-only checkpoint)."""
    run = tmp_path / "run"
    assert _convert().main(["from-hf", "--load", str(tiny_hf_dir(tmp_path / "hf")), "--out", str(run), "--quiet"]) == 0
    return run


def test_to_hf_into_a_full_disk_is_one_line_and_leaves_no_part_file(converted_run, tmp_path, capsys, monkeypatch):
    import errno

    convert = _convert()

    def full(self, spec, tensor):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(convert.ShardWriter, "write", full)
    out = tmp_path / "export"
    assert convert.main(["to-hf", "--load", str(converted_run), "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no space left on device" in err, err
    assert not list(out.glob("*.part")) and not list(out.glob("*.safetensors"))


def test_to_hf_of_a_garbage_tensor_slot_is_one_line(converted_run, tmp_path, capsys):
    from k3train.checkpoint.integrity import checksum_files
    from k3train.checkpoint.manifest import write_manifest

    step = converted_run / "checkpoints" / "step_00000000"
    data = sorted(step.glob("*.distcp"))[0]
    data.write_bytes(b"\x80\x04" + b"\x00" * (data.stat().st_size - 2))  # a pickle opcode, then garbage
    manifest = json.loads((step / "k3train.json").read_text())
    write_manifest(
        step, 0, keys=manifest["keys"], checksum="crc32", files=checksum_files(step, sorted(manifest["files"]))
    )
    assert _convert().main(["to-hf", "--load", str(converted_run), "--out", str(tmp_path / "export"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "reading tensors of checkpoint" in err, err


def test_score_refuses_a_deeply_nested_tokens_file_in_one_line(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("_tool_score_checks", CHECKOUT / "tools" / "score.py")
    assert spec is not None and spec.loader is not None
    score = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = score
    spec.loader.exec_module(score)
    tokens = tmp_path / "tokens.json"
    tokens.write_text("[" * 100_000 + "]" * 100_000)
    folder = tiny_hf_dir(tmp_path / "hf")
    assert score.main(["--load", str(folder), "--tokens-file", str(tokens), "--out", str(tmp_path / "o.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "nested deeper" in err, err
