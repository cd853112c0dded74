"""Kimi Linear both ways, with the real client: a k3train model whose config Kimi Linear expresses
exports (`to-hf --format kimi_linear`) into a folder transformers' own `KimiLinearForCausalLM`
loads with no missing/unexpected/mismatched key and computes the same logits; a Kimi Linear
model created and saved by transformers comes back through `from-hf` with the same logits; both
round trips are bit-identical; a K3-only feature is refused with one line naming it.
Tiny configs, CPU, fp32; sequence lengths cross transformers' KDA chunk of 64 and k3train's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import pytest
import torch

from k3train.checkpoint.hf_config import kimi_linear_refusal
from k3train.model.config import LinearAttnConfig, ModelConfig
from k3train.model.k3 import K3ModelChunk
from tests.unit.test_hf_conversion import _assert_identical, _load_run, _load_tool, _save_run, convert

transformers = pytest.importorskip("transformers")
from transformers import KimiLinearConfig, KimiLinearForCausalLM  # noqa: E402

score = _load_tool("score")
LENGTHS = (5, 64, 97)  # one chunk, exactly one transformers chunk, across the chunk boundary
TOLERANCE = 1e-5


def kimi_linear_model_config(**changes) -> ModelConfig:
    """A tiny k3train config that Kimi Linear expresses: plain residuals, SwiGLU, plain MoE,
    unbounded decay, low-rank output gate, no MLA output gate."""
    config = ModelConfig(
        vocab_size=384,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        mla_use_output_gate=False,
        linear_attn_config=LinearAttnConfig(
            num_heads=4,
            head_dim=16,
            gate_lower_bound=None,
            output_gate="low_rank",
            full_attn_layers=[2, 4],
            chunk_size=16,
        ),
        hidden_act="silu",
        intermediate_size=96,
        first_k_dense_replace=1,
        num_experts=8,
        num_experts_per_token=2,
        num_shared_experts=1,
        moe_intermediate_size=32,
        routed_expert_hidden_size=None,
        latent_moe_use_norm=False,
        routed_scaling_factor=2.5,
        attn_res="none",
        recompute="none",
    )
    return config.replace(**changes)


def _tokens(length: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, length), generator=torch.Generator().manual_seed(seed))


def _hf_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens, use_cache=False).logits.float()


def _k3_logits(model: K3ModelChunk, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(tokens).float()


def _load_transformers(path: Path):
    loaded = KimiLinearForCausalLM.from_pretrained(str(path), output_loading_info=True, dtype=torch.float32)
    # with output_loading_info, (model, info): transformers' annotation gives the model alone
    model, info = cast(tuple[KimiLinearForCausalLM, dict[str, Any]], loaded)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


@pytest.fixture(scope="module")
def k3train_export(tmp_path_factory):
    root = tmp_path_factory.mktemp("kimi_linear")
    config = kimi_linear_model_config()
    state = _save_run(root / "run", config)
    assert (
        convert.main(
            [
                "to-hf",
                "--load",
                str(root / "run"),
                "--out",
                str(root / "hf"),
                "--format",
                "kimi_linear",
                "--dtype",
                "fp32",
                "--quiet",
            ]
        )
        == 0
    )
    return root, config, state


def test_kimi_linear_export_loads_in_transformers_with_the_same_logits(k3train_export):
    root, config, _ = k3train_export
    hf_config = json.loads((root / "hf" / "config.json").read_text())
    assert hf_config["model_type"] == "kimi_linear" and hf_config["architectures"] == ["KimiLinearForCausalLM"]
    assert "auto_map" not in hf_config  # transformers' own code, no remote code
    hf_model = _load_transformers(root / "hf")
    k3_model, _ = score.load_model(str(root / "run"))
    for i, length in enumerate(LENGTHS):
        tokens = _tokens(length, config.vocab_size, i)
        difference = (_hf_logits(hf_model, tokens) - _k3_logits(k3_model, tokens)).abs().max().item()
        print(f"k3train → kimi_linear export, T={length}: max abs logit difference {difference:.3g}")
        assert difference <= TOLERANCE, (length, difference)


def test_kimi_linear_export_round_trips_bit_identically(k3train_export, tmp_path):
    root, config, state = k3train_export
    assert convert.main(["from-hf", "--load", str(root / "hf"), "--out", str(tmp_path / "back"), "--quiet"]) == 0
    back_config, back = _load_run(tmp_path / "back")
    assert back_config == config
    _assert_identical(state, back)


def test_kimi_linear_export_writes_no_latent_projections_and_a_4d_a_log(k3train_export):
    root, _, _ = k3train_export
    index = json.loads((root / "hf" / "model.safetensors.index.json").read_text())["weight_map"]
    assert not [n for n in index if "routed_expert" in n or "_res_" in n]
    assert "lm_head.weight" in index and "model.layers.0.self_attn.g_a_proj.weight" in index
    assert "model.layers.0.mlp.gate_proj.weight" in index
    from safetensors import safe_open

    with safe_open(str(root / "hf" / index["model.layers.0.self_attn.A_log"]), "pt") as f:
        assert f.get_slice("model.layers.0.self_attn.A_log").get_shape() == [1, 1, 4, 1]


def _transformers_model() -> KimiLinearForCausalLM:
    # the published config.json's keys, which __post_init__ takes as extra kwargs; its typed fields omit them
    config = KimiLinearConfig(  # type: ignore[call-arg]
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        v_head_dim=16,
        qk_nope_head_dim=16,
        num_experts=8,
        num_experts_per_token=2,
        routed_scaling_factor=2.446,
        linear_attn_config={
            "num_heads": 4,
            "head_dim": 16,
            "short_conv_kernel_size": 4,
            "full_attn_layers": [2, 4],
            "kda_layers": [1, 3],
        },
        first_k_dense_replace=1,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(11)
    model = KimiLinearForCausalLM(config).eval()
    with torch.no_grad():  # the tensors transformers starts constant: make them random
        g = torch.Generator().manual_seed(5)
        for name, tensor in model.state_dict().items():
            if name.endswith(("norm.weight", "layernorm.weight", "e_score_correction_bias")):
                tensor.copy_(torch.randn(tensor.shape, generator=g) * 0.3 + (0.0 if "bias" in name else 1.0))
    return model


@pytest.fixture(scope="module")
def transformers_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("from_transformers")
    model = _transformers_model()
    model.save_pretrained(str(root / "hf"))
    assert convert.main(["from-hf", "--load", str(root / "hf"), "--out", str(root / "run"), "--quiet"]) == 0
    return root, model


def test_transformers_kimi_linear_imports_with_the_same_logits(transformers_checkpoint):
    root, hf_model = transformers_checkpoint
    k3_model, _ = score.load_model(str(root / "run"))
    config = k3_model.config
    assert config.linear_attn_config.output_gate == "low_rank" and config.routed_expert_hidden_size is None
    assert config.attn_res == "none" and config.linear_attn_config.gate_lower_bound is None
    assert kimi_linear_refusal(config) is None
    direct, _ = score.load_model(str(root / "hf"))  # score.py reads the transformers folder as well
    for i, length in enumerate(LENGTHS):
        tokens = _tokens(length, config.vocab_size, 10 + i)
        expected = _hf_logits(hf_model, tokens)
        difference = (_k3_logits(k3_model, tokens) - expected).abs().max().item()
        direct_difference = (_k3_logits(direct, tokens) - expected).abs().max().item()
        print(f"transformers Kimi Linear → from-hf, T={length}: max abs logit difference {difference:.3g}")
        assert difference <= TOLERANCE and direct_difference <= TOLERANCE, (length, difference, direct_difference)


def test_transformers_kimi_linear_round_trips_bit_identically(transformers_checkpoint, tmp_path):
    root, hf_model = transformers_checkpoint
    assert (
        convert.main(
            [
                "to-hf",
                "--load",
                str(root / "run"),
                "--out",
                str(tmp_path / "hf"),
                "--format",
                "kimi_linear",
                "--dtype",
                "fp32",
                "--quiet",
            ]
        )
        == 0
    )
    again = _load_transformers(tmp_path / "hf")
    original = hf_model.state_dict()
    exported = again.state_dict()
    assert exported.keys() == original.keys()
    for name, tensor in original.items():
        assert tensor.dtype == exported[name].dtype and torch.equal(tensor, exported[name]), name


@pytest.mark.parametrize(
    "changes, feature",
    [
        ({"attn_res": "block"}, "model.attn_res"),
        ({"hidden_act": "situ"}, "model.hidden_act"),
        ({"routed_expert_hidden_size": 64}, "routed_expert_hidden_size"),
        ({"mla_use_output_gate": True}, "mla_use_output_gate"),
        (
            {
                "linear_attn_config": LinearAttnConfig(
                    num_heads=4, head_dim=16, gate_lower_bound=-5.0, output_gate="low_rank", full_attn_layers=[2, 4]
                )
            },
            "gate_lower_bound",
        ),
        (
            {
                "linear_attn_config": LinearAttnConfig(
                    num_heads=4, head_dim=16, gate_lower_bound=None, output_gate="full", full_attn_layers=[2, 4]
                )
            },
            "full-rank KDA output gate",
        ),
        ({"tie_word_embeddings": True}, "tie_word_embeddings"),
    ],
)
def test_k3_only_features_are_refused_in_one_line(changes, feature, tmp_path, capsys):
    config = kimi_linear_model_config(**changes)
    assert feature in (kimi_linear_refusal(config) or "")
    _save_run(tmp_path / "run", config, with_optimizer=False)
    capsys.readouterr()
    assert (
        convert.main(
            [
                "to-hf",
                "--load",
                str(tmp_path / "run"),
                "--out",
                str(tmp_path / "hf"),
                "--format",
                "kimi_linear",
                "--quiet",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: cannot export as Kimi Linear") and feature in err and "\n" not in err


def test_full_rank_kda_output_gate_refusal_names_the_feature_and_the_fix(tmp_path, capsys):
    """transformers' Kimi Linear has the low-rank output gate only: a full-rank K3 gate is refused
    in one line that names it, the option to train with instead, and the format that exports it."""
    lac = LinearAttnConfig(num_heads=4, head_dim=16, gate_lower_bound=None, output_gate="full", full_attn_layers=[2, 4])
    _save_run(tmp_path / "run", kimi_linear_model_config(linear_attn_config=lac), with_optimizer=False)
    capsys.readouterr()
    assert (
        convert.main(
            [
                "to-hf",
                "--load",
                str(tmp_path / "run"),
                "--out",
                str(tmp_path / "hf"),
                "--format",
                "kimi_linear",
                "--quiet",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    print(err)
    assert "\n" not in err and not (tmp_path / "hf" / "config.json").exists()
    for part in ("full-rank KDA output gate", "model.linear_attn_config.output_gate=low_rank", "--format kimi_k3"):
        assert part in err, part
