"""Transformer Engine switches where a CPU can check them (kernels/te.py, training/build.py).

Transformer Engine does not run on a CPU, so the TE path is checked with a stand-in that has TE's
constructor signatures, parameter names and FP8 state layout (tests/unit/te_stand_in.py): the
model built through the TE factory has exactly the torch path's parameter names, shapes, head
blocks, optimizer routes and values; the routed experts' grouped GEMMs run on the expert stacks;
the recipe's excluded layers and the shapes FP8 GEMMs cannot take stay out of FP8; the FP8 state
goes through the safe checkpoint code as a tensor and loads across bf16/fp8 and across backends.
The GPU side (real TE numerics) is tools/gpu_check.py's `transformer_engine` rows.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys
from typing import cast

import pytest
import torch

from k3train.checkpoint import Checkpointer
from k3train.config import JobConfig, apply_overrides
from k3train.config.recipe import ConfigError
from k3train.kernels import te as te_kernels
from k3train.model.config import ModelConfig
from k3train.model.k3 import K3ModelChunk
from k3train.model.moe import GroupedExperts
from k3train.optim.builder import parameter_costs
from k3train.optim.config import OptimizerConfig
from k3train.parallel.pipeline import PipelinePlan
from k3train.parallel.state import Layout, ParallelState
from k3train.training.build import (
    build_model,
    check_precision_support,
    forward_precision_context,
    fp8_excluded_layers,
    planning_parallel_state,
)
from tests.unit.te_stand_in import make_stand_in

CHECKOUT = pathlib.Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")


def small_model(**changes) -> ModelConfig:
    # Widths multiples of 16 (FP8 GEMMs) except KDA's b_proj (4 heads) and the AttnRes queries.
    base = ModelConfig(
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
    return base.replace(**changes)


def te_model(config: ModelConfig, te, **kwargs) -> K3ModelChunk:
    return K3ModelChunk(config, seed=3, linear_factory=te_kernels.TELinearFactory(te, CPU), **kwargs)


def description(model: torch.nn.Module) -> dict:
    """What Muon, ZeRO-1 and checkpoints see of each parameter."""
    return {
        name: (
            tuple(p.shape),
            p.dtype,
            getattr(p, "head_blocks", None),
            getattr(p, "adamw_only", False),
            getattr(p, "tensor_parallel", False),
            getattr(p, "partition_dim", None),
            getattr(p, "full_shape", None),
            getattr(p, "tp_partial_grad", False),
        )
        for name, p in model.named_parameters()
    }


# ------------------------------------------------------------------ start-up checks (CPU)
@pytest.mark.parametrize(
    "overrides, field",
    [
        (["train.precision=fp8"], "train.precision=fp8"),
        (["model.linear_backend=te"], "model.linear_backend=te"),
        (["model.linear_backend=te", "train.precision=bf16"], "model.linear_backend=te"),
    ],
)
def test_te_without_cuda_fails_at_start_up_in_one_line(overrides, field):
    config = apply_overrides(JobConfig(), overrides)
    with pytest.raises(ConfigError) as raised:
        check_precision_support(config, CPU)
    message = str(raised.value)
    assert "\n" not in message and message.startswith(field)
    assert "CUDA" in message and "pip install transformer-engine[pytorch]" in message
    check_precision_support(config, torch.device("meta"))  # planning needs nothing


def test_cpu_defaults_and_invalid_values():
    config = JobConfig()
    assert config.model.linear_backend == "auto" and config.train.precision == "fp32"
    check_precision_support(apply_overrides(config, ["train.precision=bf16"]), CPU)
    assert te_kernels.resolve_linear_backend("auto", CPU) == "torch"
    assert te_kernels.resolve_linear_backend("te", torch.device("meta")) == "torch"
    with pytest.raises(ConfigError, match="train.precision"):
        apply_overrides(config, ["train.precision=fp16"])
    with pytest.raises(ConfigError, match="fp8_recipe"):
        apply_overrides(config, ["train.fp8_recipe=nvfp4"])
    with pytest.raises(ValueError, match="linear_backend"):
        te_kernels.resolve_linear_backend("cuda", CPU)
    assert fp8_excluded_layers(small_model(), None) == [0, 3]
    assert fp8_excluded_layers(small_model(), []) == []


def test_te_missing_names_the_install_command_when_the_import_fails(monkeypatch):
    # A CUDA machine whose transformer-engine is the empty meta package (its import raises RuntimeError).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        te_kernels,
        "import_transformer_engine",
        lambda: (None, "RuntimeError: found no Transformer Engine framework extension"),
    )
    why = te_kernels.te_missing(torch.device("cuda"))
    assert "RuntimeError" in why and te_kernels.INSTALL_HINT in why and "\n" not in why
    assert te_kernels.resolve_linear_backend("auto", torch.device("cuda")) == "torch"


IMPORT_PROBE = """
import importlib.abc, json, sys

class Recorder(importlib.abc.MetaPathFinder):
    attempts = []

    def find_spec(self, fullname, path, target=None):
        if fullname.partition(".")[0].startswith("transformer_engine"):
            self.attempts.append(fullname)
        return None

sys.meta_path.insert(0, Recorder())
import dataclasses, torch
from k3train.config import JobConfig, apply_overrides
from k3train.model.config import ModelConfig
from k3train.parallel.state import ParallelState
from k3train.training.build import build_rank

config = apply_overrides(JobConfig(), ["train.precision=bf16", "train.micro_batch_size=1", "data.seq_length=8"])
config = dataclasses.replace(config, model=ModelConfig(num_hidden_layers=2, hidden_size=32, vocab_size=64,
                             num_experts=4, num_experts_per_token=2, moe_intermediate_size=16,
                             routed_expert_hidden_size=16, intermediate_size=64))
job = build_rank(config, ParallelState.single(), torch.device("cpu"))
chunk = job.model.chunks[0]
with job.schedule.forward_context():
    loss = chunk.loss(chunk(torch.zeros(1, 8, dtype=torch.long)), torch.zeros(1, 8, dtype=torch.long))
loss.backward()
print(json.dumps({"attempts": Recorder.attempts,
                  "loaded": sorted(m for m in sys.modules if m.partition(".")[0].startswith("transformer_engine"))}))
"""


def test_cpu_job_never_imports_transformer_engine():
    # A fresh interpreter: a CPU job with the default linear_backend (auto) builds, runs a bf16
    # forward/backward, and never tries to import Transformer Engine (fla: tests/unit/test_kda.py).
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_PROBE, str(CHECKOUT)],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {"attempts": [], "loaded": []}


# ------------------------------------------------------------------ the TE factory (stand-in)
@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"q_lora_rank": None},
        {"linear_attn_config": dataclasses.replace(ModelConfig().linear_attn_config, output_gate="low_rank")},
    ],
)
def test_te_model_has_the_torch_models_parameters(changes):
    config = small_model(**changes)
    te = make_stand_in()
    torch_model = K3ModelChunk(config, seed=3)
    te_built = te_model(config, te)
    assert description(te_built) == description(torch_model)
    for (name, a), (_, b) in zip(torch_model.named_parameters(), te_built.named_parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)  # init from (seed, name) alone
    costs = OptimizerConfig()
    assert parameter_costs(te_built, costs) == parameter_costs(torch_model, costs)  # Muon routes, ZeRO-1 costs
    # Every dense projection is a TE module; the router, AttnRes queries and head stay torch.
    te_linear = te_kernels.te_linear_class(te)
    projections = {name for name, module in te_built.named_modules() if isinstance(module, te_linear)}
    assert "layers.0.self_attn.q_proj" in projections and "layers.3.self_attn.o_proj" in projections
    assert (
        "layers.0.mlp.gate_proj" in projections and "layers.1.block_sparse_moe.routed_expert_down_proj" in projections
    )
    assert "layers.1.block_sparse_moe.shared_experts.down_proj" in projections
    assert not any("attn_res" in name or "_res." in name or name == "lm_head" for name in projections)
    for module in te_built.modules():  # TE's Megatron TP marks are dropped: k3train marks its own shards
        if isinstance(module, te_linear):
            assert not hasattr(module.weight, "tensor_model_parallel")

    # The same forward and gradients (the stand-in's GEMMs are plain matmuls).
    tokens = torch.randint(0, config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    losses = []
    for model in (torch_model, te_built):
        loss = model.loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=1e-6)
    for (name, a), (_, b) in zip(torch_model.named_parameters(), te_built.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_te_shards_under_tensor_parallelism_match_the_torch_shards():
    # TP=2 with sequence parallelism on the meta device: TE modules hold this rank's shard with
    # k3train's marks (full shape, partition dim, head blocks per rank), as the torch shards do.
    config = small_model()
    layout = Layout(2, tp=2, pp=1, dp=1, ep=1)
    for rank in range(2):
        state = planning_parallel_state(layout, rank, sequence_parallel=True)
        with torch.device("meta"):
            torch_model = K3ModelChunk(config, parallel=state)
            te_built = K3ModelChunk(
                config, parallel=state, linear_factory=te_kernels.TELinearFactory(make_stand_in(), torch.device("meta"))
            )
        assert description(te_built) == description(torch_model)
        weight = te_built.layers["0"].self_attn.q_proj.weight
        assert weight.is_meta and weight.tensor_parallel and weight.full_shape == (128, 32)


def test_build_model_uses_the_factory_and_keeps_first_and_last_layers_out_of_fp8(monkeypatch):
    te = make_stand_in()
    monkeypatch.setattr(te_kernels, "resolve_linear_backend", lambda choice, device: "te")
    monkeypatch.setattr(te_kernels, "import_transformer_engine", lambda: (te, ""))
    config = small_model(linear_backend="te")
    plan = PipelinePlan.from_config(config, JobConfig().parallel)
    stage = build_model(config, plan, ParallelState.single(), seed=3, device=CPU)
    reference = build_model(config.replace(linear_backend="torch"), plan, ParallelState.single(), seed=3, device=CPU)
    assert description(stage) == description(reference)
    te_linear = te_kernels.te_linear_class(te)
    kept_out = {
        name for name, m in stage.named_modules() if isinstance(m, te_kernels.FP8StateMixin) and m.keep_out_of_fp8
    }
    in_fp8 = {
        name for name, m in stage.named_modules() if isinstance(m, te_kernels.FP8StateMixin) and not m.keep_out_of_fp8
    }
    assert all(name.startswith(("layers.0.", "layers.3.")) or name.endswith("b_proj") for name in kept_out)
    assert {"layers.1.self_attn.q_proj", "layers.2.block_sparse_moe.experts.te_gemms.0.gemm"} <= in_fp8
    assert "layers.1.self_attn.b_proj" in kept_out  # 4 heads: no FP8 GEMM of width 4

    # Under the FP8 region: excluded modules run bf16, the others FP8; routed experts' groups padded.
    # 2 × 16 input tokens: TE's FP8 GEMMs want the rows a multiple of 8 (the stand-in checks it)
    tokens = torch.randint(0, config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    chunk = stage.chunks[0]
    with te_kernels.fp8_autocast(te, enabled=True, recipe=te_kernels.make_fp8_recipe(te, "delayed")):
        loss = chunk.loss(chunk(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    modules = dict(stage.named_modules())
    assert modules["layers.1.self_attn.q_proj"].fp8_calls == 1 and modules["layers.1.self_attn.q_proj"].bf16_calls == 0
    assert modules["layers.0.self_attn.q_proj"].fp8_calls == 0 and modules["layers.0.self_attn.q_proj"].bf16_calls == 1
    assert modules["layers.3.self_attn.o_proj"].fp8_calls == 0
    assert modules["layers.1.block_sparse_moe.experts.te_gemms.2.gemm"].fp8_calls == 1
    assert isinstance(modules["layers.1.self_attn.q_proj"], te_linear)
    assert all(p.grad is not None for p in stage.parameters() if p.requires_grad and p.dim() == 3)


def test_grouped_experts_run_on_the_stacks_and_send_gradients_to_them():
    te = make_stand_in()
    config = small_model()
    factory = te_kernels.TELinearFactory(te, CPU)
    torch.manual_seed(0)
    reference = GroupedExperts(config, 4)
    grouped = GroupedExperts(config, 4, factory.grouped)
    for mine, theirs in zip(grouped.stacks(), reference.stacks()):
        torch.nn.init.normal_(theirs, std=0.1)
        mine.data.copy_(theirs.data)
    assert [n for n, _ in grouped.named_parameters()] == ["w1", "w3", "w2"]  # no parameters of TE's own
    latent = torch.randn(6, config.expert_width)
    ids = torch.tensor([[0, 2], [2, 3], [0, 1], [3, 2], [2, 0], [2, 1]])
    weights = torch.rand(6, 2)
    for fp8 in (False, True):
        outputs = []
        for experts in (reference, grouped):
            for p in experts.parameters():
                p.grad = None
            with te_kernels.fp8_autocast(te, enabled=fp8, recipe=None):
                out = experts(latent, ids, weights)
            out.square().sum().backward()
            outputs.append((out.detach(), [p.grad.clone() for p in experts.stacks()]))
        torch.testing.assert_close(outputs[0][0], outputs[1][0], rtol=1e-6, atol=1e-6)
        for a, b in zip(outputs[0][1], outputs[1][1]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    # Replica stacks (expert parallelism) run through the same GEMMs.
    replicas = tuple(w.detach() * 2 for w in reference.stacks())
    order = torch.tensor([0, 0, 1, 3, 3, 3])
    rows = torch.randn(6, config.expert_width)
    ends = torch.tensor([2, 3, 3, 6])
    torch.testing.assert_close(
        grouped.forward_sorted(rows, ends, replicas), reference.forward_sorted(rows, ends, replicas)
    )
    assert order.numel() == rows.shape[0]


def test_pad_groups():
    rows = torch.arange(7.0).unsqueeze(1)
    padded, counts, keep = te_kernels.pad_groups(rows, [3, 0, 4], 4)
    assert counts == [4, 0, 4] and padded.shape == (8, 1)
    assert padded[:, 0].tolist() == [0, 1, 2, 0, 3, 4, 5, 6] and keep.tolist() == [0, 1, 2, 4, 5, 6, 7]
    torch.testing.assert_close(padded[keep], rows)


# ------------------------------------------------------------------ FP8 state and checkpoints
def run_fp8_steps(model: K3ModelChunk, te, steps: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        tokens = torch.randint(0, model.config.vocab_size, (2, 16), generator=generator)
        with te_kernels.fp8_autocast(te, enabled=True, recipe=te_kernels.make_fp8_recipe(te, "delayed")):
            model(tokens)


def fp8_states(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: te_kernels.fp8_state_tensor(cast(torch.nn.Module, m))  # a TE module: the mixin on an nn.Module
        for name, m in model.named_modules()
        if isinstance(m, te_kernels.FP8StateMixin)
    }


def test_fp8_state_format_round_trip():
    te = make_stand_in(history=5)
    linear = te_kernels.TELinearFactory(te, CPU)(32, 48)
    assert te_kernels.fp8_state_tensor(linear).numel() == 0  # never ran in FP8
    with te_kernels.fp8_autocast(te, enabled=True):
        linear(torch.randn(8, 32))
        linear(torch.randn(8, 32) * 3)
    state = linear.get_extra_state()
    assert state.dtype == torch.float32 and state.dim() == 1
    (scale_fwd, history_fwd), (scale_bwd, history_bwd) = te_kernels.parse_fp8_state(state)
    torch.testing.assert_close(history_fwd, linear.fp8_meta["scaling_fwd"].amax_history)
    torch.testing.assert_close(scale_fwd, linear.fp8_meta["scaling_fwd"].scale)
    assert history_bwd.shape == (5, 2) and scale_bwd.shape == (2,)
    with pytest.raises(ValueError, match="format"):
        te_kernels.parse_fp8_state(torch.zeros(9))

    # Loaded before the module ever ran in FP8 (a resume): held, then put in place on the first
    # FP8 forward before it is used.
    fresh = te_kernels.TELinearFactory(te, CPU)(32, 48)
    fresh.load_state_dict(linear.state_dict())
    assert "scaling_fwd" not in fresh.fp8_meta and fresh.pending_fp8_state is not None
    x = torch.randn(8, 32)
    with te_kernels.fp8_autocast(te, enabled=True):
        fresh(x)
        linear(x)
    torch.testing.assert_close(te_kernels.fp8_state_tensor(fresh), te_kernels.fp8_state_tensor(linear), rtol=0, atol=0)


def test_checkpoints_carry_fp8_state_and_load_across_precisions_and_backends(tmp_path):
    config = small_model()
    te = make_stand_in()
    fp8_model = te_model(config, te)
    run_fp8_steps(fp8_model, te, steps=3, seed=0)
    saved = fp8_states(fp8_model)
    assert sum(t.numel() > 0 for t in saved.values()) >= 10
    checkpointer = Checkpointer(tmp_path / "run")
    fp8_path = checkpointer.save(1, {"model": fp8_model})

    # fp8 → fp8 (a resume): the scales and histories come back exactly, before the first step.
    resumed = te_model(config, te)
    checkpointer.load(fp8_path, {"model": resumed})
    run_fp8_steps(resumed, te, steps=1, seed=9)
    run_fp8_steps(fp8_model, te, steps=1, seed=9)
    assert {k: v.tolist() for k, v in fp8_states(resumed).items()} == {
        k: v.tolist() for k, v in fp8_states(fp8_model).items()
    }

    # fp8 → bf16 TE model (the state is kept, unused) and → the torch backend (the state is dropped).
    bf16_te = te_model(config, te)
    checkpointer.load(fp8_path, {"model": bf16_te})
    torch_model = K3ModelChunk(config, seed=0)
    checkpointer.load(fp8_path, {"model": torch_model})
    for (name, a), (_, b) in zip(fp8_model.named_parameters(), torch_model.named_parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)

    # bf16 (empty state) → an fp8 model keeps its own fresh state; torch → TE loads the weights.
    bf16_path = Checkpointer(tmp_path / "bf16").save(1, {"model": te_model(config, te)})
    target = te_model(config, te)
    run_fp8_steps(target, te, steps=2, seed=4)
    before = fp8_states(target)
    Checkpointer(tmp_path / "bf16").load(bf16_path, {"model": target})
    assert {k: v.tolist() for k, v in fp8_states(target).items()} == {k: v.tolist() for k, v in before.items()}
    torch_path = Checkpointer(tmp_path / "torch").save(1, {"model": K3ModelChunk(config, seed=11)})
    from_torch = te_model(config, te)
    Checkpointer(tmp_path / "torch").load(torch_path, {"model": from_torch})
    for (name, a), (_, b) in zip(K3ModelChunk(config, seed=11).named_parameters(), from_torch.named_parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_fp8_forward_context_needs_transformer_engine_and_is_bf16_autocast_plus_fp8(monkeypatch):
    te = make_stand_in()
    config = apply_overrides(JobConfig(), ["train.precision=fp8", "train.fp8_recipe=current"])
    monkeypatch.setattr(te_kernels, "import_transformer_engine", lambda: (te, ""))
    context = forward_precision_context(config, CPU)
    with context():
        assert torch.is_autocast_enabled("cpu") and te.pytorch.FP8GlobalStateManager.is_fp8_enabled()
    assert not te.pytorch.FP8GlobalStateManager.is_fp8_enabled()
    monkeypatch.setattr(te_kernels, "import_transformer_engine", lambda: (None, "RuntimeError: meta package"))
    with pytest.raises(ConfigError, match="pip install transformer-engine"):
        forward_precision_context(config, CPU)
    assert type(te_kernels.make_fp8_recipe(te, "mxfp8")).__name__ == "MXFP8BlockScaling"
    assert te_kernels.make_fp8_recipe(te, "delayed", amax_history_len=16).amax_history_len == 16


def test_pretrain_refuses_fp8_on_cpu_before_anything_starts(tmp_path):
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [
            sys.executable,
            str(CHECKOUT / "pretrain_k3.py"),
            "--recipe",
            "recipes/debug.yaml",
            "--run-dir",
            str(run_dir),
            "train.precision=fp8",
            "train.device=cpu",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=CHECKOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: train.precision=fp8 needs a CUDA GPU")
    assert "pip install transformer-engine[pytorch]" in lines[0] and not run_dir.exists()
