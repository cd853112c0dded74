"""from-hf streams (k3train/checkpoint/hf_import.py): the checkpoint is written tensor by tensor
as the HF files are read, in files of at most `--max-file-size`, so the import's peak memory is
about one such file plus one HF shard plus the largest tensor, not the model. Checked by the
child process's max RSS on a model several times that size, and by what the checkpoint holds:
routed experts saved one chunk per expert, loading back bit for bit, a refused tensor leaving no
checkpoint behind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from k3train.checkpoint.hf import hf_tensor_specs
from k3train.checkpoint.hf_config import to_hf_config
from k3train.checkpoint.safe_metadata import read_metadata_safely
from k3train.model.config import LinearAttnConfig, ModelConfig
from tests.unit.test_hf_conversion import _load_run, convert
from tests.unit.test_hf_import_checks import TINY, tiny_hf_dir

CHECKOUT = Path(__file__).resolve().parents[2]
SHARD = 8 << 20
"""HF shard and k3train checkpoint file size of the memory test (bytes)."""

# Many small tensors: 64 experts in each of 2 MoE layers make ~200 MB of fp32 while the largest
# single tensor is 4 MB, so what the import holds at once is far below the model.
WIDE = ModelConfig(
    vocab_size=2048,
    hidden_size=512,
    num_hidden_layers=3,
    num_attention_heads=4,
    q_lora_rank=64,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    linear_attn_config=LinearAttnConfig(num_heads=4, head_dim=32),
    intermediate_size=1024,
    num_experts=64,
    num_experts_per_token=2,
    moe_intermediate_size=512,
    routed_expert_hidden_size=256,
)


def _write_hf_folder(folder: Path, config: ModelConfig, seed: int = 0) -> int:
    """An fp32 HF folder of `config` with random values, in shards of at most SHARD bytes;
    returns the model's fp32 bytes."""
    specs = hf_tensor_specs(config)
    shards = convert.plan_shards(specs, torch.float32, SHARD)
    folder.mkdir(parents=True)
    writer = convert.ShardWriter(folder, shards, torch.float32)
    g = torch.Generator().manual_seed(seed)
    for spec in specs:
        shape = spec.k3_shape[1:] if spec.expert is not None else spec.k3_shape
        writer.write(spec, torch.randn(shape, generator=g).reshape(spec.shape))
    weight_map = writer.finish()
    (folder / convert.INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(to_hf_config(config, dtype=torch.float32)))
    return sum(spec.numel for spec in specs) * 4


_CHILD = """
import resource, runpy, sys
tool = runpy.run_path(sys.argv[1], run_name="imported")
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
assert tool["main"](sys.argv[2:]) == 0
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(before * 1024, after * 1024)
"""


def test_from_hf_peak_memory_is_a_file_and_a_shard_not_the_model(tmp_path):
    model_bytes = _write_hf_folder(tmp_path / "hf", WIDE)
    command = [sys.executable, "-c", _CHILD, str(CHECKOUT / "tools" / "convert_checkpoint.py")]
    command += ["from-hf", "--load", str(tmp_path / "hf"), "--out", str(tmp_path / "run"), "--quiet"]
    command += ["--max-file-size", str(SHARD)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=CHECKOUT, timeout=300)
    assert done.returncode == 0, done.stderr
    before, after = (int(v) for v in done.stdout.split()[-2:])
    held = after - before
    print(f"from-hf of a {model_bytes / 1e6:.0f} MB model: max RSS grew by {held / 1e6:.1f} MB")
    # What is held at once: a checkpoint file being written (<= SHARD), the HF shard being read
    # (<= SHARD, memory-mapped) and one tensor in flight: about 3 shards. Loading the model whole
    # holds it at least once (measured 1.7x before streaming); the bound is 6 shards, a quarter of it.
    assert held < 6 * SHARD < model_bytes / 4, (held, model_bytes)
    config, state = _load_run(tmp_path / "run")
    assert config == WIDE
    name = "layers.1.block_sparse_moe.experts.w1"
    metadata = read_metadata_safely(next((tmp_path / "run" / "checkpoints").iterdir()))
    assert len(metadata.state_dict_metadata[f"model.{name}"].chunks) == WIDE.num_experts  # one per expert


def test_imported_tensors_and_expert_chunks_load_back_exactly(tmp_path):
    change = {
        "layers.1.block_sparse_moe.experts.2.w3.weight": torch.arange(16 * 16, dtype=torch.float32).reshape(16, 16)
    }
    folder = tiny_hf_dir(tmp_path / "hf", change)
    assert (
        convert.main(
            ["from-hf", "--load", str(folder), "--out", str(tmp_path / "run"), "--quiet", "--max-file-size", "2KB"]
        )
        == 0
    )
    files = list((tmp_path / "run" / "checkpoints").glob("step_*/*.distcp"))
    assert len(files) > 3  # the small file size splits the checkpoint
    _, state = _load_run(tmp_path / "run")
    assert torch.equal(
        state["layers.1.block_sparse_moe.experts.w3"][2], change["layers.1.block_sparse_moe.experts.2.w3.weight"]
    )
    assert not state["layers.1.block_sparse_moe.experts.w3"][[0, 1, 3]].any()


def test_a_refused_tensor_mid_import_is_one_line_and_leaves_no_checkpoint(tmp_path, capsys):
    name = "layers.1.block_sparse_moe.experts.3.w2.weight"
    shape = next(s.shape for s in hf_tensor_specs(TINY) if s.hf_name.endswith(name))
    bad = torch.zeros(shape)
    bad[1, 1] = float("nan")
    folder = tiny_hf_dir(tmp_path / "hf", {name: bad})
    capsys.readouterr()
    assert convert.main(["from-hf", "--load", str(folder), "--out", str(tmp_path / "run"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and name in err and "1 NaN or infinite" in err and "--allow-nonfinite" in err, err
    assert not list((tmp_path / "run" / "checkpoints").iterdir())
