"""recipes/ladder/: every size keeps K3's shape and passes tools/plan.py at its intended world size
(and, on GPUs, fits an H200 by the planner's memory model); recipes/ablations/: every sweep file
expands into runs whose overrides are valid recipe fields."""

import contextlib
import importlib.util
import io
import pathlib
import re

import pytest

from k3train.ablation.grid import expand, load_sweep_file
from k3train.config import load_config
from k3train.model.config import ModelConfig
from k3train.planning.memory import MEMORY_HEADER

CHECKOUT = pathlib.Path(__file__).resolve().parents[2]
LADDER = ["cpu-tiny", "cpu-small", "1gpu", "8gpu", "64gpu", "k3"]
H200_GIB = 141.0
spec = importlib.util.spec_from_file_location("plan_cli", CHECKOUT / "tools" / "plan.py")
assert spec is not None and spec.loader is not None
plan_cli = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plan_cli)


def intended_world_size(path: pathlib.Path) -> int:
    found = re.search(r"^# world size: (\d+)$", path.read_text(), re.MULTILINE)
    assert found, f"{path} names no '# world size: N' in its header"
    return int(found.group(1))


@pytest.mark.parametrize("size", LADDER)
def test_ladder_sizes_keep_k3s_shape(size):
    model = load_config(str(CHECKOUT / "recipes" / "ladder" / f"{size}.yaml")).model
    layers = model.num_hidden_layers
    mla = sorted(model.full_attn_layer_set)
    assert mla[-1] == layers - 1, "the last layer is MLA"
    if layers % 4 == 0:
        assert (layers - len(mla)) == 3 * len(mla), "KDA:MLA 3:1"
    else:  # K3's 93 layers: every 4th and the last
        assert mla == [i - 1 for i in range(4, layers + 1, 4)] + [layers - 1]
    assert model.routed_expert_hidden_size * 2 == model.hidden_size, "latent = hidden / 2"
    assert model.num_experts == 56 * model.num_experts_per_token, "top-k / experts = 16 / 896"
    assert model.num_shared_experts == 2 and model.first_k_dense_replace == 1
    assert model.attn_res == "block" and model.attn_res_block_size == max(1, round(layers / 8)), "about 8 blocks"
    assert model.hidden_act == "situ" and model.latent_moe_use_norm and model.balancer == "quantile_histogram"


def test_the_k3_size_is_the_k3_preset():
    model = load_config(str(CHECKOUT / "recipes" / "ladder" / "k3.yaml")).model
    assert model == ModelConfig.preset("k3")


@pytest.mark.timeout(900)
def test_ladder_sizes_pass_the_planner_at_their_world_size():
    """tools/plan.py accepts each size's layout at its intended world size; the GPU sizes up to
    64 GPUs fit an H200 (141 GiB, the planner's per-rank total: weights, gradients, optimizer,
    activations, AttnRes cache, EP buffers); the CPU sizes run in one process. Full K3 is checked
    for its layout only: its header says why its activations do not fit by the planner's model."""
    for size in LADDER:
        path = CHECKOUT / "recipes" / "ladder" / f"{size}.yaml"
        world = intended_world_size(path)
        output = io.StringIO()
        with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
            code = plan_cli.main(["--recipe", str(path), "--world-size", str(world)])
        text = output.getvalue()
        assert code == 0, f"{size}: {text[-500:]}"
        assert f"layout: world {world} " in text
        totals = [
            float(row.strip("|").split("|")[MEMORY_HEADER.index("total GiB")].replace(",", ""))
            for row in text.splitlines()
            if re.match(r"^\| pp\d+ \|", row)
        ]
        assert totals, f"{size}: no memory table in the planner's output"
        if size.startswith("cpu"):
            assert world == 1
        elif size != "k3":
            assert max(totals) <= 0.9 * H200_GIB, f"{size}: {max(totals):.1f} GiB per rank"


@pytest.mark.parametrize(
    "sweep_file", sorted((CHECKOUT / "recipes" / "ablations").glob("*.yaml")), ids=lambda p: p.stem
)
def test_sweep_files_expand_into_valid_runs(sweep_file):
    sweep = load_sweep_file(str(sweep_file))
    runs = expand(sweep)
    assert len(runs) == len(sweep.arms()) * sweep.seeds and len(sweep.arms()) >= 3
    for run in runs:
        load_config(run.recipe, list(run.overrides))  # raises on a field that does not exist
