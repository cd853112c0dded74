"""`train.offload_activations`: the saved activations go to host memory and back without changing
a bit of the loss or the weights, and the bytes moved are what the planner's host column prices."""

import pytest
import torch

from k3train.config import load_config
from k3train.data import build_data
from k3train.model.flops import training_flops_per_token
from k3train.parallel.state import ParallelState, resolve_layout
from k3train.planning.memory import rank_memory
from k3train.training.build import build_planning_rank, build_rank
from k3train.training.loop import Trainer
from k3train.training.throughput import PeakFlops
from tests.distributed.harness import CHECKOUT

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
    layout = resolve_layout(1, 1, 1, 1, 1, 1, 4, 4, config.model.vocab_size, config.model.num_experts, 8)
    predicted = rank_memory(build_planning_rank(config, layout, 0), layout, 1)
    moved = job.offload.bytes_offloaded / config.train.steps
    assert predicted.host_activations > 0 and predicted.activations <= predicted.host_activations
    assert 0.95 <= predicted.host_activations / moved <= 1.05, (moved, predicted.host_activations)
    print(f"offload moved {moved:,.0f} B per step, planner {predicted.host_activations:,.0f} B")
