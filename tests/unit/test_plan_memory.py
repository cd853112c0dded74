"""The planner's activation formula against the bytes autograd saves (`saved_tensors_hooks`,
one micro-batch, fp32, the training paths), and the pieces of the time estimate."""

import pytest
import torch

from k3train.config import load_config
from k3train.parallel.config import ModelSplitSizes
from k3train.parallel.pipeline_schedule import PipelinePlan
from k3train.parallel.state import ParallelState, resolve_layout
from k3train.planning.hardware import available_profiles, load_profile
from k3train.planning.layout_traffic import layout_step_bytes
from k3train.planning.memory import ActivationShape, chunk_activation_bytes, peak_in_flight, rank_memory
from k3train.training.build import build_model, build_planning_rank
from tests.distributed.harness import CHECKOUT

RECIPE = str(CHECKOUT / "recipes" / "debug.yaml")
WIDER = [
    "model.hidden_size=256",
    "model.linear_attn_config.num_heads=8",
    "model.num_attention_heads=8",
    "model.intermediate_size=512",
    "model.routed_expert_hidden_size=128",
    "model.moe_intermediate_size=128",
]


def saved_activation_bytes(config, batch: int, seq: int) -> int:
    plan = PipelinePlan.from_config(config.model, config.parallel)
    model = build_model(config.model, plan, ParallelState.single(), None, seed=0).chunks[0].train()
    seen = {
        (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in [*model.parameters(), *model.buffers()]
    }
    total = [0]

    def pack(tensor):
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key not in seen:
            seen.add(key)
            total[0] += storage.nbytes()
        return tensor

    ids = torch.randint(0, config.model.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model.loss(model(ids), ids)
    return total[0]


@pytest.mark.parametrize(
    "overrides",
    [[], ["model.recompute=none"], ["model.recompute=sublayer"], WIDER],
    ids=["debug attn_res", "debug none", "debug sublayer", "wider attn_res"],
)
def test_activation_formula_within_15_percent_of_saved_tensors(overrides):
    config = load_config(RECIPE, overrides)
    batch, seq = 2, 128
    measured = saved_activation_bytes(config, batch, seq)
    predicted = chunk_activation_bytes(
        config.model, (0, config.model.num_hidden_layers), ActivationShape(batch * seq, 1, False, 4), seq, "flash"
    )
    assert abs(predicted / measured - 1) < 0.15, (predicted, measured)


def test_peak_in_flight_follows_the_schedule():
    plan = PipelinePlan.build(8, 4, 1)
    assert [peak_in_flight(plan, rank, 8) for rank in range(4)] == [[4], [3], [2], [1]]
    assert peak_in_flight(plan, 0, 2) == [2]


def test_rank_memory_and_traffic_of_a_pp_layout():
    config = load_config(RECIPE, ["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true"])
    m = config.model
    layout = resolve_layout(4, 2, 2, 0, 1, 1, ModelSplitSizes.of(m))
    job = build_planning_rank(config, layout, 0)
    memory = rank_memory(job, layout, micro_batches=4)
    assert memory.weights == sum(p.numel() for p in job.model.parameters()) * 4
    assert memory.pipeline_blocks > 0 and memory.activations > 0
    traffic = layout_step_bytes(job, micro_batches=4)
    block = 2 * 128 // 2 * m.hidden_size * 4  # [b, s/tp, h] fp32
    assert traffic["pp"] == sum(job.plan.rank_step_bytes(0, block, 4).values())


def test_hardware_profiles_load():
    assert {"h100", "h200", "b200", "gb200"} <= set(available_profiles())
    assert load_profile("h200").peak_flops("bf16") == 989e12


def test_step_time_terms_follow_the_formulas():
    from k3train.model.flops import training_flops_per_token
    from k3train.parallel.pipeline_schedule import bubble_formula
    from k3train.planning.time import estimate_step_time, group_link

    config = load_config(RECIPE, [])
    m = config.model
    layout = resolve_layout(32, 2, 4, 0, 1, 1, ModelSplitSizes.of(m))
    assert group_link(layout, "tp", 8) == "nvlink" and group_link(layout, "dp", 8) == "nvlink"
    assert group_link(layout, "pp", 8) == "network"
    plan = PipelinePlan.build(m.num_hidden_layers, 4, 1, m.attn_res, m.attn_res_block_size)
    estimate = estimate_step_time(
        m,
        layout,
        plan,
        load_profile("h100"),
        micro_batch_size=2,
        seq_length=128,
        micro_batches=8,
        precision="bf16",
        comm_bytes={},
    )
    bubble_share = estimate.bubble_s / (estimate.compute_s + estimate.bubble_s)
    assert bubble_share == pytest.approx(bubble_formula(4, 1, 8))
    tokens = 2 * 128 * 8 * layout.dp
    assert estimate.model_flops_per_step == pytest.approx(training_flops_per_token(m, 128).total * tokens)
    assert 0 < estimate.mfu <= 0.45 + 1e-9
