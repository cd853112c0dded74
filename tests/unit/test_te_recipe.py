"""recipes/k3-1gpu.yaml: every K3 feature at about 1B active parameters, planned to fill one
141 GB H200 without exceeding it (tools/plan.py on the meta device; no GPU needed)."""

import pathlib
import subprocess
import sys

from k3train.config import load_config
from k3train.model.flops import parameter_counts
from k3train.planning.memory import MEMORY_HEADER

CHECKOUT = pathlib.Path(__file__).resolve().parents[2]
RECIPE = CHECKOUT / "recipes" / "k3-1gpu.yaml"
H200_GIB = 141e9 / 2**30  # 141 GB of HBM3e = 131.3 GiB


def test_recipe_has_every_k3_feature_at_about_1b_active():
    config = load_config(str(RECIPE))
    model = config.model
    k3 = load_config(str(CHECKOUT / "recipes" / "k3.yaml")).model
    assert model.vocab_size == k3.vocab_size and model.hidden_act == k3.hidden_act == "situ"
    assert model.linear_attn_config.gate_lower_bound == k3.linear_attn_config.gate_lower_bound
    assert model.linear_attn_config.head_dim == k3.linear_attn_config.head_dim
    assert model.linear_attn_config.output_gate == "full" and model.mla_use_output_gate
    assert (model.qk_nope_head_dim, model.qk_rope_head_dim, model.v_head_dim) == (
        k3.qk_nope_head_dim,
        k3.qk_rope_head_dim,
        k3.v_head_dim,
    )
    assert model.q_lora_rank and model.kv_lora_rank and model.full_attn_layer_set == frozenset({3, 7, 11, 15, 19, 23})
    assert model.first_k_dense_replace == 1 and model.num_shared_experts == 2 and model.latent_moe_use_norm
    assert model.routed_expert_hidden_size * 2 == model.hidden_size and model.balancer == k3.balancer
    assert model.attn_res == "block" and model.num_hidden_layers // model.attn_res_block_size == 8
    assert model.recompute == k3.recompute and config.optimizer.name == "muon"
    assert (config.parallel.tp, config.parallel.pp, config.parallel.ep) == (1, 1, 1)
    counts = parameter_counts(model)
    assert 0.9e9 <= counts.active - counts.embedding <= 1.2e9 and counts.total > 5e9


def test_plan_fits_one_h200():
    result = subprocess.run(
        [
            sys.executable,
            str(CHECKOUT / "tools" / "plan.py"),
            "--recipe",
            str(RECIPE),
            "--world-size",
            "1",
            "--hardware",
            "h200",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=CHECKOUT,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| pp0 ")]
    assert len(rows) == 1, result.stdout
    total_gib = float(rows[0].strip("|").split("|")[MEMORY_HEADER.index("total GiB")])
    assert 0.8 * H200_GIB <= total_gib <= H200_GIB, total_gib  # fills the GPU, does not exceed it
    assert "MFU" in result.stdout
