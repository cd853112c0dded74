"""from-hf reads configs as transformers writes and reads them: Kimi Linear's own flat field names
(`linear_num_heads`, `linear_head_dim`, `linear_conv_kernel_dim`) and its defaults for what
`save_pretrained` leaves out, grouped routing that keeps every group (the same choice as
ungrouped routing), and folders that `save_pretrained` of the remote-code K3 model wrote (text
model_type `kimi_k3_text`). Checked against transformers 5.23 on tiny models, CPU, fp32."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from k3train.checkpoint.hf_config import from_hf_config
from k3train.checkpoint.hf_kimi_linear_config import kimi_linear_text
from k3train.model.config import ModelConfig
from tests.unit.test_hf_conversion import _assert_identical, _load_run, _save_run, convert
from tests.unit.test_hf_kimi_linear import TOLERANCE, _hf_logits, _k3_logits, _tokens, score

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, KimiLinearConfig, KimiLinearForCausalLM  # noqa: E402


def _flat_kimi_linear(**changes) -> KimiLinearForCausalLM:
    """A transformers Kimi Linear built from its own field names only: no `linear_attn_config`,
    no `layer_types` (its default: full attention on layer 5 of 5), grouped routing over 2
    groups keeping both."""
    fields: dict[str, Any] = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        v_head_dim=16,
        qk_nope_head_dim=16,
        num_local_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=2,
        linear_num_heads=2,
        linear_head_dim=8,
        linear_conv_kernel_dim=3,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    fields.update(changes)
    config = KimiLinearConfig(**fields)
    torch.manual_seed(3)
    model = KimiLinearForCausalLM(config).eval()
    with torch.no_grad():  # transformers starts norms, biases and the routing bias constant
        g = torch.Generator().manual_seed(4)
        for name, tensor in model.state_dict().items():
            if name.endswith(("norm.weight", "layernorm.weight", "e_score_correction_bias")):
                tensor.copy_(torch.randn(tensor.shape, generator=g) * 0.3 + (0.0 if "bias" in name else 1.0))
    return model


def test_transformers_field_names_and_equivalent_grouped_routing_import_with_the_same_logits(tmp_path):
    model = _flat_kimi_linear()
    model.save_pretrained(str(tmp_path / "hf"))
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert "linear_attn_config" not in written and written["linear_num_heads"] == 2  # the flat names only
    assert convert.main(["from-hf", "--load", str(tmp_path / "hf"), "--out", str(tmp_path / "run"), "--quiet"]) == 0
    k3_model, _ = score.load_model(str(tmp_path / "run"))
    lac = k3_model.config.linear_attn_config
    assert (lac.num_heads, lac.head_dim, lac.short_conv_kernel_size, lac.full_attn_layers) == (2, 8, 3, [5])
    for i, length in enumerate((5, 70)):
        tokens = _tokens(length, 300, 20 + i)
        difference = (_k3_logits(k3_model, tokens) - _hf_logits(model, tokens)).abs().max().item()
        print(f"flat-field Kimi Linear, n_group=2 topk_group=2, T={length}: max abs logit difference {difference:.3g}")
        assert difference <= TOLERANCE, (length, difference)


def test_a_config_without_a_field_means_transformers_default():
    text = kimi_linear_text(
        {"model_type": "kimi_linear", "num_hidden_layers": 9, "mlp_layer_types": ["dense"] * 2 + ["sparse"] * 7}
    )
    assert text["linear_attn_config"]["num_heads"] == KimiLinearConfig().linear_num_heads == 32
    assert text["linear_attn_config"]["head_dim"] == KimiLinearConfig().linear_head_dim == 128
    assert text["linear_attn_config"]["short_conv_kernel_size"] == KimiLinearConfig().linear_conv_kernel_dim == 4
    expected = KimiLinearConfig(num_hidden_layers=9).layer_types
    assert text["linear_attn_config"]["full_attn_layers"] == [
        i + 1 for i, k in enumerate(expected) if k == "full_attention"
    ]
    assert text["first_k_dense_replace"] == 2
    # a linear_attn_config entry wins over the flat name, as in KimiLinearConfig.__post_init__
    both = {"model_type": "kimi_linear", "linear_num_heads": 2, "linear_attn_config": {"num_heads": 6}}
    assert kimi_linear_text(both)["linear_attn_config"]["num_heads"] == KimiLinearConfig(**both).linear_num_heads == 6


@pytest.mark.parametrize("groups, kept", [(4, 2), (2, 1)])
def test_grouped_routing_that_drops_groups_is_refused_in_one_line(groups, kept, tmp_path, capsys):
    model = _flat_kimi_linear(n_group=groups, topk_group=kept)
    model.save_pretrained(str(tmp_path / "hf"))
    capsys.readouterr()
    assert convert.main(["from-hf", "--load", str(tmp_path / "hf"), "--out", str(tmp_path / "run"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"keeping {kept} of {groups} expert groups" in err, err


@pytest.mark.parametrize("attn_res", ["block", "full", "none"])
def test_a_folder_saved_by_the_remote_code_model_imports_bit_identically(attn_res, tmp_path):
    config = ModelConfig(num_hidden_layers=3, attn_res=attn_res)
    state = _save_run(tmp_path / "run", config, with_optimizer=False)
    assert (
        convert.main(
            ["to-hf", "--load", str(tmp_path / "run"), "--out", str(tmp_path / "hf"), "--dtype", "fp32", "--quiet"]
        )
        == 0
    )
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), trust_remote_code=True, dtype=torch.float32)
    loaded.save_pretrained(str(tmp_path / "saved"))
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved["text_config"]["model_type"] == "kimi_k3_text" and saved["text_config"]["attn_res"] == attn_res
    assert from_hf_config(saved) == config
    assert convert.main(["from-hf", "--load", str(tmp_path / "saved"), "--out", str(tmp_path / "back"), "--quiet"]) == 0
    back_config, back = _load_run(tmp_path / "back")
    assert back_config == config
    _assert_identical(state, back)
