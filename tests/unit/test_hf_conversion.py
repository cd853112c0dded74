"""Hugging Face conversion (k3train/checkpoint/hf.py, tools/convert_checkpoint.py, tools/score.py):
bit-identical k3train → HF → k3train round trips, equal logits through tools/score.py, the hub
names/shapes/config of the hub layout (docs/hf_conversion.md), refusals, sharding and the A_log variants."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from k3train.checkpoint import Checkpointer
from k3train.checkpoint.hf import (
    HF_LM_HEAD,
    HF_TEXT_TENSOR_NAME,
    HFConversionError,
    check_hf_tensors,
    export_tensor,
    hf_name,
    hf_tensor_specs,
    import_tensor,
    k3_state_shapes,
    k3train_name,
)
from k3train.checkpoint.hf_config import from_hf_config, to_hf_config
from k3train.config import JobConfig, load_config, save_config
from k3train.model.config import LinearAttnConfig, ModelConfig
from k3train.model.k3 import K3ModelChunk

CHECKOUT = Path(__file__).resolve().parents[2]
P = "language_model.model."


def _load_tool(name: str):
    spec = importlib.util.spec_from_file_location(f"_tool_{name}", CHECKOUT / "tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


convert = _load_tool("convert_checkpoint")


def _randomise(model: K3ModelChunk, seed: int = 7) -> None:
    """Make the tensors that start as constants (AttnRes queries and gains, QB biases, A_log,
    norms) random, so a round trip really checks them."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith(
                ("_res.proj.weight", "norm.weight", "layernorm.weight", "A_log", "e_score_correction_bias")
            ):
                tensor.copy_(
                    torch.randn(tensor.shape, generator=g) * 0.5 + (1.0 if name.endswith("norm.weight") else 0.0)
                )


def _save_run(run: Path, config: ModelConfig, step: int = 3, with_optimizer: bool = True) -> dict[str, torch.Tensor]:
    """A run directory like pretrain_k3.py leaves: config.yaml + checkpoints/step_NNNNNNNN."""
    model = K3ModelChunk(config)
    _randomise(model)
    job = JobConfig()
    job.model = config
    save_config(job, str(run / "config.yaml"))
    app_state: dict[str, Any] = {"model": model}
    if with_optimizer:  # optimizer entries must not confuse the converter
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        optimizer.step()
        app_state.update(optimizer=optimizer, progress={"step": step})
    Checkpointer(run / "checkpoints").save(step, app_state)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _load_run(run: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    config = load_config(str(run / "config.yaml"), []).model
    model = K3ModelChunk(config)
    latest = Checkpointer(run / "checkpoints").latest()
    assert latest is not None
    Checkpointer(run / "checkpoints").load(latest, {"model": model})
    return config, model.state_dict()


def _assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name], b[name]), name


def _headers(hf_dir: Path) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """name → (dtype, shape, file) over every shard."""
    out = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                out[name] = (sl.get_dtype(), tuple(sl.get_shape()), file.name)
    return out


def _tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


@pytest.fixture(scope="module")
def debug_export(tmp_path_factory):
    """The debug model (randomised), its checkpoint, and an fp32 multi-shard export read in small
    slabs of experts."""
    root = tmp_path_factory.mktemp("hf")
    state = _save_run(root / "run", ModelConfig())
    rc = convert.main(
        [
            "to-hf",
            "--load",
            str(root / "run"),
            "--out",
            str(root / "hf"),
            "--dtype",
            "fp32",
            "--max-shard-size",
            "1MB",
            "--read-budget",
            "100KB",
            "--quiet",
        ]
    )
    assert rc == 0
    return root, state


def test_round_trip_is_bit_identical(debug_export):
    root, state = debug_export
    assert len(list((root / "hf").glob("model-*-of-*.safetensors"))) > 1
    assert convert.main(["from-hf", "--load", str(root / "hf"), "--out", str(root / "back"), "--quiet"]) == 0
    assert (root / "back" / "checkpoints" / "step_00000000").is_dir()
    config, back = _load_run(root / "back")
    assert config == ModelConfig()  # the k3train sub-dict restores every field
    _assert_identical(state, back)
    for name, tensor in state.items():  # the tensors that start constant really were random
        if name.endswith(("_res.proj.weight", "e_score_correction_bias")):
            assert tensor.abs().sum() > 0, name


def test_logits_of_hf_export_equal_the_checkpoint(debug_export, tmp_path):
    root, _ = debug_export
    g = torch.Generator().manual_seed(3)
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps(torch.randint(0, 259, (2, 24), generator=g).tolist()))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    results = []
    for source in (root / "run" / "checkpoints" / "step_00000003", root / "hf"):
        out = tmp_path / f"{source.name}.json"
        subprocess.run(
            [
                sys.executable,
                str(CHECKOUT / "tools" / "score.py"),
                "--load",
                str(source),
                "--tokens-file",
                str(tokens),
                "--out",
                str(out),
            ],
            check=True,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        data = json.loads(out.read_text())
        assert data["logits_shape"] == [2, 24, 384]
        results.append(torch.tensor(data["logits"], dtype=torch.float32))
    difference = (results[0] - results[1]).abs().max().item()
    print(f"max abs logit difference checkpoint vs HF export (fp32): {difference}")
    assert difference == 0.0
    assert results[0].abs().max() > 0


def test_hf_names_and_shapes_follow_the_hub_layout(debug_export):
    root, _ = debug_export
    headers = _headers(root / "hf")
    shape = {name: s for name, (_, s, _) in headers.items()}
    expected = {
        # model level
        P + "embed_tokens.weight": (384, 128),
        P + "norm.weight": (128,),
        HF_LM_HEAD: (384, 128),
        P + "output_attn_res_norm.weight": (128,),
        P + "output_attn_res_proj.weight": (1, 128),
        # layer 0: KDA + dense MLP + AttnRes
        P + "layers.0.input_layernorm.weight": (128,),
        P + "layers.0.post_attention_layernorm.weight": (128,),
        P + "layers.0.self_attn.q_proj.weight": (128, 128),
        P + "layers.0.self_attn.k_proj.weight": (128, 128),
        P + "layers.0.self_attn.v_proj.weight": (128, 128),
        P + "layers.0.self_attn.q_conv1d.weight": (128, 1, 4),
        P + "layers.0.self_attn.k_conv1d.weight": (128, 1, 4),
        P + "layers.0.self_attn.v_conv1d.weight": (128, 1, 4),
        P + "layers.0.self_attn.f_a_proj.weight": (32, 128),
        P + "layers.0.self_attn.f_b_proj.weight": (128, 32),
        P + "layers.0.self_attn.dt_bias": (128,),
        P + "layers.0.self_attn.A_log": (4,),
        P + "layers.0.self_attn.b_proj.weight": (4, 128),
        P + "layers.0.self_attn.g_proj.weight": (128, 128),
        P + "layers.0.self_attn.o_norm.weight": (32,),
        P + "layers.0.self_attn.o_proj.weight": (128, 128),
        P + "layers.0.mlp.gate_proj.weight": (256, 128),
        P + "layers.0.mlp.up_proj.weight": (256, 128),
        P + "layers.0.mlp.down_proj.weight": (128, 256),
        P + "layers.0.self_attention_res_norm.weight": (128,),
        P + "layers.0.self_attention_res_proj.weight": (1, 128),
        P + "layers.0.mlp_res_norm.weight": (128,),
        P + "layers.0.mlp_res_proj.weight": (1, 128),
        # layer 3: Gated MLA (1-based layer 4) + MoE
        P + "layers.3.self_attn.q_a_proj.weight": (64, 128),
        P + "layers.3.self_attn.q_a_layernorm.weight": (64,),
        P + "layers.3.self_attn.q_b_proj.weight": (4 * 48, 64),
        P + "layers.3.self_attn.kv_a_proj_with_mqa.weight": (32 + 16, 128),
        P + "layers.3.self_attn.kv_a_layernorm.weight": (32,),
        P + "layers.3.self_attn.kv_b_proj.weight": (4 * 64, 32),
        P + "layers.3.self_attn.g_proj.weight": (128, 128),
        P + "layers.3.self_attn.o_proj.weight": (128, 128),
        # layer 1: MoE
        P + "layers.1.block_sparse_moe.gate.weight": (16, 128),
        P + "layers.1.block_sparse_moe.gate.e_score_correction_bias": (16,),
        P + "layers.1.block_sparse_moe.routed_expert_down_proj.weight": (64, 128),
        P + "layers.1.block_sparse_moe.routed_expert_norm.weight": (64,),
        P + "layers.1.block_sparse_moe.routed_expert_up_proj.weight": (128, 64),
        P + "layers.1.block_sparse_moe.experts.0.w1.weight": (64, 64),
        P + "layers.1.block_sparse_moe.experts.15.w3.weight": (64, 64),
        P + "layers.1.block_sparse_moe.experts.7.w2.weight": (64, 64),
        P + "layers.1.block_sparse_moe.shared_experts.gate_proj.weight": (64, 128),
        P + "layers.1.block_sparse_moe.shared_experts.up_proj.weight": (64, 128),
        P + "layers.1.block_sparse_moe.shared_experts.down_proj.weight": (128, 64),
    }
    for name, want in expected.items():
        assert shape.get(name) == want, name
    # Every name follows the hub layout; nothing of k3train's own naming leaks out.
    pattern = re.compile(
        r"language_model\.lm_head\.weight|language_model\.model\.(embed_tokens\.weight|norm\.weight|"
        r"output_attn_res_(norm|proj)\.weight|layers\.\d+\.("
        r"(input_layernorm|post_attention_layernorm|(self_attention|mlp)_res_(norm|proj))\.weight|"
        r"self_attn\.((q|k|v|g|o|b|f_a|f_b)_proj\.weight|(q|k|v)_conv1d\.weight|dt_bias|A_log|o_norm\.weight|"
        r"(q_a_proj|q_a_layernorm|q_b_proj|kv_a_proj_with_mqa|kv_a_layernorm|kv_b_proj)\.weight)|"
        r"mlp\.(gate|up|down)_proj\.weight|"
        r"block_sparse_moe\.(gate\.weight|gate\.e_score_correction_bias|routed_expert_(down_proj|norm|up_proj)\.weight|"
        r"experts\.\d+\.w[123]\.weight|shared_experts\.(gate|up|down)_proj\.weight)))"
    )
    bad = [n for n in headers if not pattern.fullmatch(n)]
    assert not bad
    assert len(headers) == len(hf_tensor_specs(ModelConfig()))
    assert sum(".experts." in n for n in headers) == 7 * 16 * 3
    assert not any(n.startswith(P + "layers.0.block_sparse_moe") or n.startswith(P + "layers.1.mlp.") for n in headers)
    config = json.loads((root / "hf" / "config.json").read_text())
    assert config["model_type"] == "kimi_k3" and config["architectures"] == ["KimiK3ForConditionalGeneration"]
    text = config["text_config"]
    assert (
        text["model_type"] == "kimi_linear"
        and "quantization_config" not in config
        and "quantization_config" not in text
    )
    assert (text["eos_token_id"], text["bos_token_id"], text["pad_token_id"]) == (256, 257, 258)
    assert text["linear_attn_config"]["full_attn_layers"] == [4, 8]
    assert text["linear_attn_config"]["kda_layers"] == [1, 2, 3, 5, 6, 7]


def test_max_shard_size_gives_shards_and_a_correct_index(debug_export, tmp_path):
    root, _ = debug_export
    out = tmp_path / "hf_bf16"
    assert (
        convert.main(
            [
                "to-hf",
                "--load",
                str(root / "run" / "checkpoints"),
                "--out",
                str(out),
                "--max-shard-size",
                "300KB",
                "--quiet",
            ]
        )
        == 0
    )
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 2
    assert files == [f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)]
    assert not list(out.glob("*.part"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    headers = _headers(out)
    assert set(index["weight_map"]) == set(headers)
    assert all(headers[name][2] == file for name, file in index["weight_map"].items())
    sizes = {"F32": 4, "BF16": 2}
    total = 0
    per_file: dict[str, int] = {}
    for name, (dtype, shape, file) in headers.items():
        nbytes = sizes[dtype] * int(torch.Size(shape).numel())
        total += nbytes
        per_file[file] = per_file.get(file, 0) + nbytes
        keep_fp32 = name.endswith(("e_score_correction_bias", "A_log", "dt_bias", "conv1d.weight"))
        assert dtype == ("F32" if keep_fp32 else "BF16"), name
    assert index["metadata"]["total_size"] == total
    assert max(per_file.values()) <= 300_000
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    # a second export into the same directory is refused without --overwrite
    assert convert.main(["to-hf", "--load", str(root / "run"), "--out", str(out), "--quiet"]) == 2


def test_k3_preset_config_json_carries_the_published_values():
    config = to_hf_config(ModelConfig.preset("k3"))
    text = config["text_config"]
    published = {
        "vocab_size": 163840,
        "hidden_size": 7168,
        "num_hidden_layers": 93,
        "intermediate_size": 33792,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "num_attention_heads": 96,
        "num_key_value_heads": 96,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "num_experts": 896,
        "num_experts_per_token": 16,
        "num_shared_experts": 2,
        "moe_intermediate_size": 3072,
        "routed_expert_hidden_size": 3584,
        "latent_moe_use_norm": True,
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True,
        "routed_scaling_factor": 1.0,
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "attn_res_block_size": 12,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "max_position_embeddings": 1048576,
        "num_nextn_predict_layers": 0,
    }
    for key, value in published.items():
        assert text[key] == value, key
    assert config["model_type"] == "kimi_k3" and text["model_type"] == "kimi_linear"
    assert "quantization_config" not in config and "quantization_config" not in text
    linear = text["linear_attn_config"]
    assert {
        k: linear[k]
        for k in ("num_heads", "head_dim", "short_conv_kernel_size", "use_full_rank_gate", "gate_lower_bound")
    } == {
        "num_heads": 96,
        "head_dim": 128,
        "short_conv_kernel_size": 4,
        "use_full_rank_gate": True,
        "gate_lower_bound": -5.0,
    }
    full = list(range(4, 93, 4)) + [93]
    assert linear["full_attn_layers"] == full and len(full) == 24
    assert linear["kda_layers"] == [i for i in range(1, 94) if i not in full]
    assert len(linear["kda_layers"]) == 69 and linear["kda_layers"][:4] == [1, 2, 3, 5]
    assert linear["kda_layers"][-3:] == [89, 90, 91]
    assert from_hf_config(config) == ModelConfig.preset("k3")


def test_k3_preset_tensor_list_matches_the_hub_without_building_weights():
    specs = hf_tensor_specs(ModelConfig.preset("k3"))
    assert len(specs) == 249_756  # the published checkpoint's named-tensor count for the text model
    shapes = {s.hf_name: s.shape for s in specs}
    assert shapes[P + "embed_tokens.weight"] == (163840, 7168)
    assert shapes[P + "layers.0.self_attn.q_conv1d.weight"] == (12288, 1, 4)
    assert shapes[P + "layers.0.self_attn.A_log"] == (96,)
    assert shapes[P + "layers.3.self_attn.q_b_proj.weight"] == (18432, 1536)
    assert shapes[P + "layers.92.self_attn.kv_b_proj.weight"] == (24576, 512)
    assert shapes[P + "layers.92.self_attn.kv_a_proj_with_mqa.weight"] == (576, 7168)
    assert shapes[P + "layers.0.mlp.down_proj.weight"] == (7168, 33792)
    assert shapes[P + "layers.1.block_sparse_moe.experts.895.w1.weight"] == (3072, 3584)
    assert shapes[P + "layers.1.block_sparse_moe.experts.895.w2.weight"] == (3584, 3072)
    assert shapes[P + "layers.1.block_sparse_moe.shared_experts.gate_proj.weight"] == (6144, 7168)
    assert shapes[P + "layers.91.block_sparse_moe.routed_expert_up_proj.weight"] == (7168, 3584)
    assert shapes[P + "layers.5.self_attention_res_proj.weight"] == (1, 7168)
    assert P + "layers.3.self_attn.q_proj.weight" not in shapes and P + "layers.4.self_attn.q_proj.weight" in shapes
    padded = {s.hf_name: s.shape for s in hf_tensor_specs(ModelConfig.preset("debug"), a_log_width=32)}
    assert padded[P + "layers.0.self_attn.A_log"] == (32,)


@pytest.mark.parametrize(
    "config",
    [
        ModelConfig(),
        ModelConfig(
            q_lora_rank=None,
            num_shared_experts=0,
            latent_moe_use_norm=False,
            mla_use_output_gate=False,
            tie_word_embeddings=True,
            hidden_act="silu",
        ),
        ModelConfig(attn_res="none", first_k_dense_replace=2, balancer="sign", recompute="none"),
        ModelConfig(
            num_experts=0,
            num_experts_per_token=0,
            linear_attn_config=LinearAttnConfig(
                gate_low_rank_dim=16, full_attn_layers=[1, 5], chunk_size=16, gate_lower_bound=None
            ),
        ),
    ],
)
def test_mapping_covers_the_model_and_config_round_trips(config):
    with torch.device("meta"):
        model = K3ModelChunk(config)
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == k3_state_shapes(config)
    specs = hf_tensor_specs(config)
    assert len({s.hf_name for s in specs}) == len(specs)
    assert (HF_LM_HEAD in {s.hf_name for s in specs}) == (not config.tie_word_embeddings)
    assert from_hf_config(to_hf_config(config, allow_k3train_only=True)) == config


MAPPED_CONFIGS = [
    ModelConfig(),
    ModelConfig.preset("debug"),
    ModelConfig(
        q_lora_rank=None,
        num_shared_experts=0,
        latent_moe_use_norm=False,
        mla_use_output_gate=False,
        tie_word_embeddings=True,
        hidden_act="silu",
    ),
    ModelConfig(attn_res="full", first_k_dense_replace=2),
    ModelConfig(
        attn_res="none",
        num_experts=0,
        num_experts_per_token=0,
        linear_attn_config=LinearAttnConfig(full_attn_layers=[1, 5]),
    ),
]


@pytest.mark.parametrize("config", MAPPED_CONFIGS)
def test_every_model_tensor_has_one_hub_name_and_back(config):
    """The renaming rules are a bijection between the meta model's tensors (experts split) and hub
    names: a parameter added to the model without a rule fails here (hf_name refuses it)."""
    with torch.device("meta"):
        model = K3ModelChunk(config)
    by_hub: dict[str, tuple[str, object]] = {}
    count = 0
    for name, tensor in model.state_dict().items():
        experts = (
            range(tensor.shape[0]) if re.fullmatch(r"layers\.\d+\.block_sparse_moe\.experts\.w[123]", name) else [None]
        )
        for expert in experts:
            hub = hf_name(name, expert)
            assert HF_TEXT_TENSOR_NAME.fullmatch(hub), hub
            assert k3train_name(hub) == (name, expert)
            by_hub[hub] = (name, expert)
            count += 1
    assert len(by_hub) == count  # no two model tensors share a hub name
    specs = hf_tensor_specs(config)
    tied = {HF_LM_HEAD} if config.tie_word_embeddings else set()
    assert [s.hf_name for s in specs if s.hf_name in by_hub] == [s.hf_name for s in specs]
    assert {s.hf_name for s in specs} == set(by_hub) - tied
    assert all((s.k3_name, s.expert) == by_hub[s.hf_name] for s in specs)


def test_a_model_tensor_the_mapping_does_not_cover_is_refused(monkeypatch):
    import k3train.model.k3 as k3_module

    class GrownModel(K3ModelChunk):
        def __init__(self, config):
            super().__init__(config)
            self.get_submodule("layers.0.self_attn").new_gain = torch.nn.Parameter(torch.ones(4))

    monkeypatch.setattr(k3_module, "K3ModelChunk", GrownModel)
    assert "layers.0.self_attn.new_gain" in k3_state_shapes(ModelConfig())
    with pytest.raises(
        HFConversionError, match=r"layers\.0\.self_attn\.new_gain has no name in the Kimi K3 hub layout"
    ):
        hf_tensor_specs(ModelConfig())
    with pytest.raises(HFConversionError, match="not a tensor name"):
        k3train_name(P + "layers.0.self_attn.new_gain")


def test_hub_file_order_of_a_layer_is_the_published_listing():
    """The shards' byte layout follows this order: the decay-gate tensors sit after f_b_proj."""
    specs = hf_tensor_specs(ModelConfig())
    kda = [s.hf_name[len(P + "layers.0.") :] for s in specs if s.hf_name.startswith(P + "layers.0.self_attn.")]
    assert kda == [
        f"self_attn.{n}"
        for n in (
            "q_proj.weight",
            "k_proj.weight",
            "v_proj.weight",
            "q_conv1d.weight",
            "k_conv1d.weight",
            "v_conv1d.weight",
            "f_a_proj.weight",
            "f_b_proj.weight",
            "dt_bias",
            "A_log",
            "b_proj.weight",
            "g_proj.weight",
            "o_norm.weight",
            "o_proj.weight",
        )
    ]
    layer1 = [s.hf_name[len(P + "layers.1.") :] for s in specs if s.hf_name.startswith(P + "layers.1.")]
    assert layer1[:3] == ["input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight"]
    moe = [n for n in layer1 if n.startswith("block_sparse_moe.") and ".experts." not in n]
    assert moe == [
        "block_sparse_moe." + n
        for n in (
            "gate.weight",
            "gate.e_score_correction_bias",
            "routed_expert_down_proj.weight",
            "routed_expert_norm.weight",
            "routed_expert_up_proj.weight",
            "shared_experts.gate_proj.weight",
            "shared_experts.up_proj.weight",
            "shared_experts.down_proj.weight",
        )
    ]
    first_expert = layer1.index("block_sparse_moe.experts.0.w1.weight")
    assert layer1[first_expert - 1] == "block_sparse_moe.routed_expert_down_proj.weight"
    assert layer1[first_expert : first_expert + 4] == [
        "block_sparse_moe.experts.0.w1.weight",
        "block_sparse_moe.experts.0.w3.weight",
        "block_sparse_moe.experts.0.w2.weight",
        "block_sparse_moe.experts.1.w1.weight",
    ]
    assert layer1[-4:] == [
        "self_attention_res_norm.weight",
        "self_attention_res_proj.weight",
        "mlp_res_norm.weight",
        "mlp_res_proj.weight",
    ]
    assert [s.hf_name for s in specs[-4:]] == [
        P + "output_attn_res_norm.weight",
        P + "output_attn_res_proj.weight",
        P + "norm.weight",
        HF_LM_HEAD,
    ]


def test_every_attn_res_mode_is_stated_in_a_public_field():
    """config.json states the AttnRes mode itself (`attn_res`), the block size only where it means
    something (Block), and keeps nothing but training settings and numerics in the private
    `k3train` entry; every mode exports (the flag that once let full/none through is accepted)."""
    training_only = {"init_std", "balancer", "balancer_bins", "balancer_sign_rate", "recompute", "recompute_glu"}
    training_only |= {"linear_backend", "linear_attn_config"}
    for mode in ("block", "full", "none"):
        for allow in (False, True):
            text = to_hf_config(ModelConfig(attn_res=mode), allow_k3train_only=allow)["text_config"]
            assert text["attn_res"] == mode and ("attn_res_block_size" in text) == (mode == "block")
            private = set(text["k3train"]) - ({"attn_res_block_size"} if mode != "block" else set())
            assert private <= training_only, private
            assert set(text["k3train"]["linear_attn_config"]) == {"chunk_size"}
            assert from_hf_config(to_hf_config(ModelConfig(attn_res=mode))) == ModelConfig(attn_res=mode)


def test_variant_model_round_trips_through_the_tool(tmp_path):
    """Tied head, full-rank q_proj MLA, no shared experts, SwiGLU, plain residuals, padded A_log."""
    config = ModelConfig(
        hidden_size=64,
        num_hidden_layers=4,
        vocab_size=300,
        q_lora_rank=None,
        num_shared_experts=0,
        tie_word_embeddings=True,
        hidden_act="silu",
        attn_res="none",
        num_experts=4,
        num_experts_per_token=2,
        routed_expert_hidden_size=32,
        moe_intermediate_size=32,
        intermediate_size=96,
        linear_attn_config=LinearAttnConfig(num_heads=2, head_dim=32),
    )
    state = _save_run(tmp_path / "run", config, with_optimizer=False)
    args = ["to-hf", "--load", str(tmp_path / "run"), "--out", str(tmp_path / "hf"), "--dtype", "fp32", "--quiet"]
    assert convert.main(args + ["--pad-a-log"]) == 0  # attn_res none exports (formerly needed the flag)
    assert convert.main(args + ["--pad-a-log", "--allow-k3train-only", "--overwrite"]) == 0  # still accepted
    headers = _headers(tmp_path / "hf")
    assert HF_LM_HEAD not in headers
    assert headers[P + "layers.0.self_attn.A_log"][1] == (32,)
    assert P + "layers.3.self_attn.q_proj.weight" in headers
    assert convert.main(["from-hf", "--load", str(tmp_path / "hf"), "--out", str(tmp_path / "back"), "--quiet"]) == 0
    back_config, back = _load_run(tmp_path / "back")
    assert back_config == config
    _assert_identical(state, back)


def save_sharded_worker(env, payload):
    """Runs in each of 2 gloo ranks: save the model state as DTensors, sharded like expert and
    tensor parallelism would (experts on dim 0 and dim 1, matrices on dim 1, vectors on dim 0)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from k3train.checkpoint import write_manifest

    mesh = init_device_mesh("cpu", (env.world_size,))
    sharded = {}
    for name, tensor in payload["state"].items():
        if name.endswith(("experts.w1", "experts.w3")):
            placement = Shard(0)
        elif tensor.ndim >= 2:
            placement = Shard(1)
        else:
            placement = Shard(0)
        sharded[name] = distribute_tensor(tensor, mesh, [placement])
    dcp.save({"model": sharded}, storage_writer=dcp.FileSystemWriter(payload["path"]))
    dist.barrier()
    if env.rank == 0:
        write_manifest(payload["path"], 3, world_size=env.world_size)
    return True


def test_checkpoint_saved_sharded_over_two_ranks_exports_the_same_tensors(debug_export, tmp_path):
    from tests.distributed.harness import run_workers

    root, state = debug_export
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copyfile(root / "run" / "config.yaml", run / "config.yaml")
    step = run / "checkpoints" / "step_00000003"
    run_workers(
        2, "tests.unit.test_hf_conversion:save_sharded_worker", {"path": str(step), "state": state}, timeout_s=180
    )
    metadata = convert.CheckpointTensorReader(step).metadata.state_dict_metadata
    assert len(metadata["model.layers.1.block_sparse_moe.experts.w1"].chunks) == 2
    assert (
        convert.main(
            [
                "to-hf",
                "--load",
                str(step),
                "--out",
                str(tmp_path / "hf"),
                "--dtype",
                "fp32",
                "--read-budget",
                "70KB",
                "--quiet",
            ]
        )
        == 0
    )
    reference, exported = _tensors(root / "hf"), _tensors(tmp_path / "hf")
    assert exported.keys() == reference.keys()
    for name, tensor in exported.items():
        assert torch.equal(tensor, reference[name]), name


# ---------------------------------------------------------------------------- refusals


def _debug_hf_config() -> dict:
    return to_hf_config(ModelConfig())


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda c: c["text_config"].update(mla_use_nope=False), "rotary MLA"),
        (lambda c: c["text_config"].pop("mla_use_nope"), "rotary MLA"),
        (lambda c: c["text_config"].update(num_expert_group=8, topk_group=4), "grouped top-k"),
        (
            lambda c: c.update(
                quantization_config={"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"}
            ),
            "quantised checkpoint",
        ),
        (lambda c: c["text_config"].update(num_nextn_predict_layers=1), "multi-token-prediction"),
    ],
)
def test_unrepresentable_configs_are_refused(change, message):
    config = _debug_hf_config()
    change(config)
    with pytest.raises(HFConversionError, match=message) as info:
        from_hf_config(config)
    assert "\n" not in str(info.value)


def test_a_low_rank_output_gate_config_imports_as_low_rank():
    # Formerly refused; k3train now has Kimi Linear's low-rank g_a_proj/g_b_proj output gate.
    config = _debug_hf_config()
    config["text_config"]["linear_attn_config"]["use_full_rank_gate"] = False
    model_config = from_hf_config(config)
    assert model_config.linear_attn_config.output_gate == "low_rank"
    assert model_config.kda_output_gate_rank == model_config.linear_attn_config.head_dim


def test_unloadable_tensors_are_refused():
    config = ModelConfig()
    specs = hf_tensor_specs(config)
    available = {s.hf_name: s.shape for s in specs}
    assert check_hf_tensors(dict(available, **{"vision_tower.patch_embed.weight": (4, 4)}), specs) == [
        "vision_tower.patch_embed.weight"
    ]
    packed = dict(available)
    expert = P + "layers.1.block_sparse_moe.experts.0.w1"
    del packed[expert + ".weight"]
    packed.update({expert + ".weight_packed": (64, 32), expert + ".weight_scale": (64, 2)})
    with pytest.raises(HFConversionError, match="quantised experts"):
        check_hf_tensors(packed, specs)
    with pytest.raises(HFConversionError, match="low-rank KDA output gate"):
        check_hf_tensors(dict(available, **{P + "layers.0.self_attn.g_a_proj.weight": (32, 128)}), specs)
    missing = {k: v for k, v in available.items() if not k.endswith("o_norm.weight")}
    with pytest.raises(HFConversionError, match=r"lacks tensors .*o_norm\.weight.*\(6 in all\)"):
        check_hf_tensors(missing, specs)
    with pytest.raises(HFConversionError, match="shape the config does not imply"):
        check_hf_tensors(dict(available, **{P + "norm.weight": (64,)}), specs)


def test_refusal_is_one_line_from_the_command_line(debug_export, tmp_path, capsys):
    root, _ = debug_export
    hf = tmp_path / "rotary"
    shutil.copytree(root / "hf", hf)
    config = json.loads((hf / "config.json").read_text())
    config["text_config"]["mla_use_nope"] = False
    (hf / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert convert.main(["from-hf", "--load", str(hf), "--out", str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "rotary MLA" in err and "\n" not in err
    assert not (tmp_path / "out" / "checkpoints").exists()


# ---------------------------------------------------------------------------- A_log and slabs


def test_a_log_import_accepts_the_published_variants():
    config = ModelConfig()
    spec = next(s for s in hf_tensor_specs(config) if s.k3_name == "layers.0.self_attn.A_log")
    heads = torch.tensor([0.5, -1.0, 2.0, 0.25])
    assert torch.equal(import_tensor(spec, heads), heads)
    assert torch.equal(import_tensor(spec, torch.cat([heads, torch.zeros(28)])), heads)
    assert torch.equal(import_tensor(spec, heads.view(1, 1, 4, 1)), heads)
    with pytest.raises(HFConversionError, match="padding"):
        import_tensor(spec, torch.cat([heads, torch.ones(28)]))
    with pytest.raises(HFConversionError, match="shape"):
        import_tensor(spec, heads[:3])
    padded_spec = dataclasses.replace(spec, shape=(32,))
    assert padded_spec.keep_fp32
    exported = export_tensor(padded_spec, heads, torch.bfloat16)
    assert exported.dtype == torch.float32 and exported.shape == (32,)
    assert torch.equal(import_tensor(spec, exported), heads)


def test_expert_slabs_respect_saved_chunks_and_budget():
    assert convert.expert_slabs(16, [0, 16], 10, 1000) == [(0, 16)]
    assert convert.expert_slabs(16, [0, 16], 10, 45) == [(0, 4), (4, 8), (8, 12), (12, 16)]
    # expert-parallel shards of 4: whole shards merged up to the budget, never split needlessly
    assert convert.expert_slabs(16, [0, 4, 8, 12, 16], 10, 80) == [(0, 8), (8, 16)]
    assert convert.expert_slabs(16, [0, 4, 8, 12, 16], 10, 60) == [(0, 4), (4, 8), (8, 12), (12, 16)]
    assert convert.expert_slabs(4, [0, 4], 10, 1) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert convert.parse_size("5GB") == 5 * 10**9 and convert.parse_size("2GiB") == 2 * 2**30
