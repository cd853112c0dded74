"""`k3train.training.build`: the planning build (meta device, no process groups) lays a rank out
exactly as the real build does; the model-only build is the job's model."""

import dataclasses

import torch

from k3train.config import JobConfig
from k3train.model.config import ModelConfig
from k3train.parallel.pipeline import PipelinePlan
from k3train.parallel.state import Layout, ParallelState
from k3train.training.build import build_model, build_planning_rank, build_rank, planning_parallel_state


def small_job(**parallel) -> JobConfig:
    base = JobConfig()
    model = ModelConfig(
        num_hidden_layers=4,
        hidden_size=32,
        intermediate_size=64,
        num_experts=4,
        num_experts_per_token=2,
        moe_intermediate_size=16,
        routed_expert_hidden_size=16,
        vocab_size=64,
        attn_res_block_size=2,
    )
    return dataclasses.replace(
        base,
        model=model,
        parallel=dataclasses.replace(base.parallel, **parallel),
        train=dataclasses.replace(base.train, micro_batch_size=2, seed=5),
        data=dataclasses.replace(base.data, seq_length=8),
    )


def shapes(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.shape) for name, p in module.named_parameters()}


def test_meta_build_matches_the_real_build_on_one_process():
    config = small_job()
    real = build_rank(config, ParallelState.single(), torch.device("cpu"))
    meta = build_planning_rank(config, Layout(1, 1, 1, 1, 1), rank=0)
    assert all(p.is_meta for p in meta.model.parameters())
    assert not any(p.is_meta for p in real.model.parameters())
    assert shapes(meta.model) == shapes(real.model) and shapes(real.model)
    assert {name: b.shape for name, b in meta.model.named_buffers()} == {
        name: b.shape for name, b in real.model.named_buffers()
    }
    assert [len(b.params) for b in meta.reducer.buckets] == [len(b.params) for b in real.reducer.buckets]
    assert meta.optimizer.owned_parameter_names() == real.optimizer.owned_parameter_names()
    assert meta.plan == real.plan and meta.schedule.tensor_shape == real.schedule.tensor_shape == (2, 8, 32)


def test_model_only_build_is_the_jobs_model_from_the_seed():
    config = small_job()
    plan = PipelinePlan.from_config(config.model, config.parallel)
    job = build_rank(config, ParallelState.single(), torch.device("cpu"))
    model = build_model(config.model, plan, ParallelState.single(), seed=config.train.seed)
    assert len(model.chunks) == 1
    job_state = job.model.state_dict()
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, job_state[name], rtol=0, atol=0)


def test_planning_state_has_ranks_but_no_process_groups():
    layout = Layout(8, tp=2, pp=2, dp=2, ep=2)
    state = planning_parallel_state(layout, rank=5, sequence_parallel=True)
    assert (state.tp_rank, state.dp_rank, state.pp_rank) == (1, 0, 1)
    assert state.tp.size == 2 and state.pp.size == 2 and state.ep.size == 2
    assert all(getattr(group, "process_group", None) is None for group in (state.tp, state.dp, state.pp, state.ep))
    stage = build_model(
        small_job().model, PipelinePlan.build(4, 2, attn_res="block", block_size=2), state, device=torch.device("meta")
    )
    names = shapes(stage)
    assert "lm_head.weight" in names and "embed_tokens.weight" not in names  # pp rank 1 holds the head
    assert names["lm_head.weight"] == (32, 32)  # vocabulary rows split over tp = 2
