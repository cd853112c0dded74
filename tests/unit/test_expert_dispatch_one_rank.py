"""The expert-parallel dispatcher on one rank: equal to the local experts, dropped slots counted,
expert parameters marked and sliced, the start-up checks, and the static-shape guard's host reads."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from k3train.model.balance import Balancer
from k3train.model.config import ModelConfig
from k3train.model.moe import LatentMoE
from k3train.parallel.comm import Group, TrafficCounter
from k3train.parallel.expert import Compute, ExpertParallel, Mode
from tests.distributed.workers_expert import (
    StaticShapeGuard,
    no_host_reads,
    reference_capacity_keep,
    use_expert_parallel,
)


def single_group() -> Group:
    return Group("ep", (0,), 0, None, TrafficCounter())


def moe_pair(mode: Mode, capacity_factor: float, compute: Compute = "grouped"):
    config = dataclasses.replace(ModelConfig(), num_experts=8, num_experts_per_token=3)
    torch.manual_seed(0)
    reference = LatentMoE(config).double()
    for param in reference.parameters():
        torch.nn.init.normal_(param, 0.0, 0.1)
    expert_parallel = ExpertParallel(single_group(), 8, mode, capacity_factor, 2, compute)
    moe = LatentMoE(config).double()
    moe.load_state_dict(reference.state_dict())
    use_expert_parallel(moe, expert_parallel)
    return reference, moe


@pytest.mark.parametrize("mode", ["balanced", "capacity"])
@pytest.mark.parametrize("compute", ["grouped", "gather"])
def test_dispatch_on_one_rank_equals_local_experts(mode, compute):
    reference, moe = moe_pair(mode, 1.0, compute)
    x = torch.randn(2, 7, 128, dtype=torch.float64)
    expected, got = reference(x), moe(x)
    (expected.square().sum() + expected.sum()).backward()
    (got.square().sum() + got.sum()).backward()
    assert (expected - got).abs().max() < 1e-12
    for (name, a), b in zip(reference.named_parameters(), moe.parameters()):
        assert (a.grad - b.grad).abs().max() < 1e-12 * max(1.0, a.grad.abs().max().item()), name
    stats = moe.pop_step_stats()
    assert stats.dropped_slots == 0 and stats.routed_slots == 42 and stats.micro_batches == 1


def test_dropped_slots_count_as_zero_weight_and_are_counted_per_layer():
    reference, moe = moe_pair("capacity", 0.5)
    x = torch.randn(2, 8, 128, dtype=torch.float64)
    captured = {}
    original = reference.experts.forward

    def dropping(latent, expert_ids, weights):
        captured["keep"] = reference_capacity_keep(expert_ids, weights.detach(), 1, 8, 24)
        return original(latent, expert_ids, weights * captured["keep"])

    reference.experts.forward = dropping
    for _ in range(2):  # two micro-batches accumulate
        assert (reference(x) - moe(x)).abs().max() < 1e-12
    assert torch.equal(moe.last_dispatch.keep, captured["keep"])
    stats = moe.pop_step_stats()
    assert stats.routed_slots == 2 * 48 and stats.dropped_slots == 2 * 24 and stats.micro_batches == 2
    assert stats.as_dict()["dropped_fraction"] == 0.5
    assert moe.pop_step_stats().routed_slots == 0  # reset
    assert moe.pop_step_stats().expert_load.shape == (8,)


def test_expert_params_are_marked_and_sliced():
    config = dataclasses.replace(ModelConfig(), num_experts=8)
    full = LatentMoE(config)
    with torch.no_grad():
        for param in full.parameters():
            param.normal_()
    group = Group("ep", (0, 1, 2, 3), 2, None, TrafficCounter())  # rank 2 of 4 (no collective is run)
    expert_parallel = ExpertParallel(group, 8, "capacity", 1.0)
    moe = LatentMoE(config)
    moe.load_state_dict(full.state_dict())
    use_expert_parallel(moe, expert_parallel)
    assert moe.experts.w1.shape == (2, 64, 64) and torch.equal(moe.experts.w2, full.experts.w2[4:6])
    for param in (moe.experts.w1, moe.experts.w3, moe.experts.w2):
        assert param.expert_parallel and param.expert_offset == 4 and param.full_shape[0] == 8
    built = LatentMoE(config, expert_parallel=expert_parallel)
    assert built.experts.w3.shape == (2, 64, 64) and built.experts.w3.expert_offset == 4


def test_from_state_requires_sequence_parallel_with_tensor_parallel():
    ep = Group("ep", (0, 1), 0, None, TrafficCounter())
    config = SimpleNamespace(expert_dispatch="balanced", capacity_factor=1.25, max_replicas_per_rank=2)
    state = SimpleNamespace(ep=ep, layout=SimpleNamespace(tp=2), sequence_parallel=False)
    with pytest.raises(ValueError, match="sequence_parallel"):
        ExpertParallel.from_state(state, config, 16)
    state.sequence_parallel = True
    assert ExpertParallel.from_state(state, config, 16).num_local_experts == 8
    state.ep = Group("ep", (0,), 0, None, TrafficCounter())
    assert ExpertParallel.from_state(state, config, 16) is None


def test_static_shape_guard_catches_host_reads():
    """The guard the distributed static-shape check relies on: the CPU loop path of the grouped
    matmul reads group ends on the host and is caught; the gather path passes."""
    _, moe = moe_pair("balanced", 1.25, "grouped")
    moe.balancer = Balancer()  # the histogram balancer's bincount is not part of the dispatch path
    x = torch.randn(1, 6, 128, dtype=torch.float64)
    with pytest.raises(AssertionError, match="host"):
        with no_host_reads(), StaticShapeGuard():
            moe(x)
    with pytest.raises(AssertionError, match="bincount"):
        with StaticShapeGuard():
            torch.bincount(torch.tensor([1, 2]))
    _, moe = moe_pair("balanced", 1.25, "gather")
    moe.balancer = Balancer()  # the histogram balancer's bincount is not part of the dispatch path
    with no_host_reads(), StaticShapeGuard():
        moe(x).sum().backward()


@pytest.mark.parametrize("compute", ["grouped", "gather"])
def test_experts_grouped_forward_is_the_modules_own_glu(compute):
    """The dispatcher's entry into the experts module: rows in any order through their expert
    ids (others: zero rows), the same numbers as the module's sorted single-process GLU, and
    with replica stacks handed in it uses those instead of its own."""
    config = dataclasses.replace(ModelConfig(), num_experts=4)
    experts = LatentMoE(config).double().experts
    torch.manual_seed(1)
    for param in experts.parameters():
        torch.nn.init.normal_(param, 0.0, 0.1)
    rows = torch.randn(10, config.routed_expert_hidden_size, dtype=torch.float64)
    ids = torch.tensor([3, 0, -1, 2, 4, 0, 3, 1, 9, 2])
    out = experts.grouped_forward(rows, ids, compute=compute)
    valid = (ids >= 0) & (ids < 4)
    assert torch.equal(out[~valid], torch.zeros_like(out[~valid]))
    for row in valid.nonzero().flatten().tolist():
        one = experts.forward_sorted(rows[row : row + 1], torch.bincount(ids[row : row + 1], minlength=4).cumsum(0))
        assert (out[row] - one[0]).abs().max() < 1e-14, row
    replicas = tuple(torch.flip(w.detach(), dims=[0]) for w in experts.stacks())  # expert g -> 3 - g
    flipped = experts.grouped_forward(rows, torch.where(valid, 3 - ids, ids), replicas, compute=compute)
    assert (flipped - out).abs().max() < 1e-14
