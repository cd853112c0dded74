"""Activation options against the reference run and the planner: `train.offload_activations` (the
saved activations to host memory and back) and `model.recompute_glu` (SiTU-GLU's factors rebuilt
in backward) change not a bit of the losses or the weights; the bytes offloaded are the
planner's host column, and the bytes recomputation saves are the planner's saving."""

import pytest
import torch

from k3train.config import load_config
from k3train.data import build_data
from k3train.model.flops import training_flops_per_token
from k3train.parallel.state import ParallelState, layout_of
from k3train.planning.memory import ActivationShape, chunk_activation_bytes, rank_memory
from k3train.training.build import build_planning_rank, build_rank
from k3train.training.loop import Trainer
from k3train.training.throughput import PeakFlops
from tests.distributed.harness import CHECKOUT
from tests.unit.test_plan_memory import WIDER, saved_activation_bytes

RECIPE = str(CHECKOUT / "recipes" / "debug.yaml")
BASE = [
    "train.device=cpu",
    "train.steps=2",
    "data.seq_length=64",
    "train.micro_batch_size=2",
    "train.global_batch_size=2",
    "train.eval_interval=0",
    "schedule.warmup_steps=1",
]
MIXED = ["train.precision=bf16", "train.weights=bf16_with_fp32_master_shards"]


def train(overrides: list[str]):
    config = load_config(RECIPE, [*BASE, *overrides])
    parallel = ParallelState.single()
    torch.manual_seed(config.train.seed)
    job = build_rank(config, parallel, torch.device("cpu"))
    data = build_data(config.data, config.train.global_batch_size, config.train.steps, config.model.vocab_size)
    flops = training_flops_per_token(config.model, config.data.seq_length).total
    trainer = Trainer(
        config,
        job.model,
        job.optimizer,
        data,
        torch.device("cpu"),
        flops,
        PeakFlops(1.0, "MFU"),
        None,
        parallel,
        job.reducer,
        job.schedule,
    )
    losses = [trainer.train_step()["loss"] for _ in range(config.train.steps)]
    return config, job, losses


@pytest.mark.parametrize("precision", [[], MIXED], ids=["fp32", "bf16 weights, fp32 master shards"])
def test_offload_is_exact_and_moves_what_the_planner_prices(precision):
    _, reference, reference_losses = train(precision)
    config, job, losses = train([*precision, "train.offload_activations=true"])
    assert losses == reference_losses
    for (name, param), (_, expected) in zip(job.model.named_parameters(), reference.model.named_parameters()):
        assert torch.equal(param, expected), name
    assert job.offload is not None and reference.offload is None
    # One micro-batch per step, two steps: the bytes moved per step (each storage once per forward)
    # against the host column.
    layout = layout_of(1, config.parallel, config.model)
    predicted = rank_memory(build_planning_rank(config, layout, 0), layout, 1)
    moved = job.offload.bytes_offloaded / config.train.steps
    assert predicted.host_activations > 0 and predicted.activations <= predicted.host_activations
    assert 0.95 <= predicted.host_activations / moved <= 1.05, (moved, predicted.host_activations)
    print(f"offload moved {moved:,.0f} B per step, planner {predicted.host_activations:,.0f} B")


@pytest.mark.parametrize("precision", [[], MIXED], ids=["fp32", "bf16 weights, fp32 master shards"])
def test_glu_recompute_is_exact(precision):
    _, reference, reference_losses = train(precision)
    _, job, losses = train([*precision, "model.recompute_glu=true"])
    assert losses == reference_losses
    for (name, param), (_, expected) in zip(job.model.named_parameters(), reference.model.named_parameters()):
        assert torch.equal(param, expected), name


@pytest.mark.parametrize("overrides", [[], WIDER], ids=["debug", "wider"])
def test_glu_recompute_saves_what_the_planner_prices(overrides):
    """fp32, one micro-batch of 2 × 128: the saved bytes drop by the planner's saving (4 fp32
    factors replaced by the gate and up outputs, per intermediate element), within 5%."""
    plain, recomputed = load_config(RECIPE, overrides), load_config(RECIPE, [*overrides, "model.recompute_glu=true"])
    measured = saved_activation_bytes(plain, 2, 128) - saved_activation_bytes(recomputed, 2, 128)
    shape = ActivationShape(256, 1, False, 4)
    layers = (0, plain.model.num_hidden_layers)
    predicted = chunk_activation_bytes(plain.model, layers, shape, 128) - chunk_activation_bytes(
        recomputed.model, layers, shape, 128
    )
    assert measured > 0 and abs(predicted / measured - 1) <= 0.05, (measured, predicted)
