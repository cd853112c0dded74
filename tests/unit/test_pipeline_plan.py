"""The pipeline plan, the block protocol's accounting and the schedule orders, in one process.

The distributed checks (tests/distributed/test_pipeline.py) measure traffic and memory on gloo;
here the plan itself is held to docs/design.md §2.1's table, to closed forms, to a brute-force simulation
of what every rank holds, and the schedules to Megatron's warmup counts and a deadlock-free,
ideal-bubble simulation. The executor runs once with pp = 1 (plain gradient accumulation).
"""

import itertools
import math

import pytest
import torch

from k3train.model.config import ModelConfig
from k3train.model.k3 import K3ModelChunk
from k3train.parallel.comm import Group, TrafficCounter
from k3train.parallel.pipeline import PipelineExecutor, residual_shape, theoretical_peak_blocks
from k3train.parallel.pipeline_cache import BlockCache, BlockCacheError
from k3train.parallel.pipeline_schedule import (
    PROTOCOLS,
    PipelineConfigError,
    PipelinePlan,
    blocks_before_layer,
    bubble_formula,
    interleaved_one_f_one_b,
    one_f_one_b,
    partition_layers,
    schedule_steps,
    simulate,
)


# ---------------------------------------------------------------------------- partition
def test_even_partition_and_override():
    assert partition_layers(8, 2, 2) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert partition_layers(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]  # the first L mod C take one more
    assert partition_layers(8, 2, 2, [2, 3, 1, 2]) == [(0, 2), (2, 5), (5, 6), (6, 8)]


@pytest.mark.parametrize(
    "layers,pp,v,override,message",
    [
        (3, 2, 2, None, "cannot fill"),
        (8, 2, 2, [4, 4], "one layer count per chunk"),
        (8, 2, 1, [4, 5], "sums to 9"),
        (8, 2, 2, [4, 0, 2, 2], "empty chunk"),
    ],
)
def test_partition_errors(layers, pp, v, override, message):
    with pytest.raises(PipelineConfigError, match=message):
        partition_layers(layers, pp, v, override)


def test_blocks_before_layer():
    assert [blocks_before_layer("block", 3, layer) for layer in range(9)] == [0, 1, 1, 1, 2, 2, 2, 3, 3]
    assert [blocks_before_layer("full", 3, layer) for layer in range(4)] == [0, 2, 4, 6]
    assert blocks_before_layer("none", 3, 7) == 0


def test_plan_matches_the_model_pushes():
    """blocks_at agrees with what K3ModelChunk slices actually push (block, full, none)."""
    for attn_res in ("block", "full", "none"):
        config = ModelConfig(
            num_hidden_layers=5,
            hidden_size=32,
            intermediate_size=32,
            num_experts=0,
            attn_res=attn_res,
            attn_res_block_size=2,
            recompute="none",
        )
        plan = PipelinePlan.build(5, 2, 1, attn_res, 2, [2, 3])
        model = K3ModelChunk(config, layer_range=(0, 2))
        state = model(torch.zeros(1, 3, dtype=torch.long))
        assert len(state.blocks) == plan.blocks_at[1], attn_res


# ---------------------------------------------------------------------------- protocol accounting
def test_spec_section_2_1_table():
    """P = 2, V = 2, 8 layers, S = 2: naive 6, paper 5, exact 3 blocks per micro-batch."""
    plan = PipelinePlan.build(8, 2, 2, "block", 2)
    assert plan.chunks == ((0, 2), (2, 4), (4, 6), (6, 8))
    assert [plan.rank_of(c) for c in range(4)] == [0, 1, 0, 1]
    hops = {p: [list(plan.hop_blocks(c, p)) for c in range(3)] for p in PROTOCOLS}
    assert hops["naive"] == [[0], [0, 1], [0, 1, 2]]
    assert hops["paper"] == [[0], [0, 1], [1, 2]]
    assert hops["exact"] == [[0], [1], [2]]
    assert {p: plan.blocks_per_micro_batch(p) for p in PROTOCOLS} == {"naive": 6, "paper": 5, "exact": 3}
    # Backward mirrors it: c3 returns b2's gradient, c2 b1's, c1 b0's (plus each partial sum).
    assert [list(plan.received_blocks(c)) for c in range(4)] == [[], [0], [1], [2]]


@pytest.mark.parametrize("pp,v", list(itertools.product([2, 3, 4, 8], [1, 2, 3, 4])))
def test_closed_forms_one_block_per_chunk(pp, v):
    """Chunks of S layers, block size S (one block per chunk): the paper's Eq. 7/8 and the exact
    delta's P(P-1)(2V-1)/2."""
    chunks = pp * v
    plan = PipelinePlan.build(2 * chunks, pp, v, "block", 2)
    assert plan.blocks_per_micro_batch("naive") == chunks * (chunks - 1) // 2
    assert plan.blocks_per_micro_batch("paper") == pp * (pp - 1) // 2 + (v - 1) * pp * pp
    assert plan.blocks_per_micro_batch("exact") == pp * (pp - 1) * (2 * v - 1) // 2
    if v == 1:  # no rank sees a micro-batch twice: the cache cannot help
        assert len({plan.blocks_per_micro_batch(p) for p in PROTOCOLS}) == 1


def _brute_force_deltas(plan: PipelinePlan) -> list[list[int]]:
    """Simulate what every rank holds, hop by hop, with sets."""
    held: list[set[int]] = [set() for _ in range(plan.pp)]
    deltas = []
    for c in range(plan.num_chunks):
        rank = plan.rank_of(c)
        held[rank] |= set(range(plan.blocks_at[c + 1]))  # input + what it pushes
        if c < plan.num_chunks - 1:
            receiver = plan.rank_of(c + 1)
            output = set(range(plan.blocks_at[c + 1]))
            deltas.append(sorted(output - held[receiver]))
    return deltas


SETTINGS = [  # (layers, pp, v, attn_res, block size, pipeline_layers)
    (8, 2, 2, "block", 3, [2, 3, 1, 2]),
    (8, 4, 2, "block", 3, None),
    (12, 3, 2, "block", 5, [1, 3, 2, 2, 3, 1]),
    (16, 4, 2, "block", 2, None),
    (16, 2, 4, "block", 3, None),
    (9, 3, 3, "full", 1, None),
    (93, 8, 2, "block", 12, None),  # K3 full size
    (8, 4, 2, "none", 2, None),
]


@pytest.mark.parametrize("setting", SETTINGS, ids=[f"L{s[0]}-P{s[1]}-V{s[2]}-{s[3]}-S{s[4]}" for s in SETTINGS])
def test_exact_delta_is_what_the_receiver_lacks(setting):
    layers, pp, v, attn_res, size, override = setting
    plan = PipelinePlan.build(layers, pp, v, attn_res, size, override)
    exact = [list(plan.hop_blocks(c)) for c in range(plan.num_chunks - 1)]
    assert exact == _brute_force_deltas(plan)
    for c in range(plan.num_chunks - 1):
        e, p, n = (set(plan.hop_blocks(c, x)) for x in ("exact", "paper", "naive"))
        assert e <= p <= n
    assert (
        plan.blocks_per_micro_batch("exact")
        <= plan.blocks_per_micro_batch("paper")
        <= plan.blocks_per_micro_batch("naive")
    )


def test_rank_bytes_add_up():
    plan = PipelinePlan.build(8, 4, 2, "block", 3)
    per_rank = [plan.rank_step_bytes(r, 100, 4) for r in range(4)]
    assert sum(b["forward"] for b in per_rank) == plan.step_bytes(100, 4, backward=False)
    assert sum(b["forward"] + b["backward"] for b in per_rank) == plan.step_bytes(100, 4)


def test_theoretical_peak_one_f_one_b():
    """V = 1: rank r keeps min(P - r, M) micro-batches in flight, each with its output's blocks
    (the last rank one micro-batch with its input's)."""
    plan = PipelinePlan.build(8, 4, 1, "block", 3)
    for m in (1, 2, 6):
        for r in range(3):
            assert theoretical_peak_blocks(plan, r, m) == min(4 - r, m) * plan.blocks_at[r + 1]
        assert theoretical_peak_blocks(plan, 3, m) == plan.blocks_at[3]


def test_tied_embeddings_refused_under_pp():
    from k3train.parallel.config import ParallelConfig

    with pytest.raises(PipelineConfigError, match="tie_word_embeddings"):
        PipelinePlan.from_config(ModelConfig(tie_word_embeddings=True), ParallelConfig(pp=2))


# ---------------------------------------------------------------------------- schedules
def test_one_f_one_b_order():
    assert [repr(s) for s in one_f_one_b(4, 0, 5)] == ["F0", "F1", "F2", "F3", "B0", "F4", "B1", "B2", "B3", "B4"]
    assert [repr(s) for s in one_f_one_b(4, 3, 2)] == ["F0", "B0", "F1", "B1"]
    assert [repr(s) for s in one_f_one_b(4, 1, 1)] == ["F0", "B0"]


def test_interleaved_warmup_is_megatrons():
    for pp, v, m in [(2, 2, 4), (4, 2, 8), (4, 3, 8), (3, 2, 9)]:
        for rank in range(pp):
            steps = interleaved_one_f_one_b(pp, v, rank, m)
            warmup = min(2 * (pp - rank - 1) + (v - 1) * pp, m * v)
            assert all(s.kind == "forward" for s in steps[:warmup])
            assert warmup == m * v or steps[warmup].kind == "forward" and steps[warmup + 1].kind == "backward"
            # every (chunk, micro-batch) once each way, backward after forward
            forward = [(s.virtual_stage, s.micro_batch) for s in steps if s.kind == "forward"]
            backward = [(s.virtual_stage, s.micro_batch) for s in steps if s.kind == "backward"]
            assert sorted(forward) == sorted(backward) == sorted(itertools.product(range(v), range(m)))
            position = {(s.kind, s.virtual_stage, s.micro_batch): i for i, s in enumerate(steps)}
            assert all(position[("forward", *k)] < position[("backward", *k)] for k in backward)
    assert [repr(s) for s in interleaved_one_f_one_b(2, 2, 1, 2)] == [
        "F0",
        "F1",
        "F0v1",
        "B0v1",
        "F1v1",
        "B1v1",
        "B0",
        "B1",
    ]


def test_interleaved_refuses_micro_batches_not_multiple_of_pp():
    with pytest.raises(PipelineConfigError, match="multiple of parallel.pp=4"):
        schedule_steps(4, 2, 0, 6)
    schedule_steps(4, 1, 0, 6)  # 1F1B takes any number


@pytest.mark.parametrize("pp,v", [(2, 1), (4, 1), (8, 1), (2, 2), (4, 2), (3, 3), (4, 4)])
def test_schedules_do_not_deadlock_and_reach_the_ideal_bubble(pp, v):
    for m in (pp, 2 * pp, 3 * pp) if v > 1 else (1, 3, pp, 2 * pp + 1):
        result = simulate(pp, v, m, forward_time=1.0, backward_time=2.0)
        assert math.isclose(result.bubble_fraction, bubble_formula(pp, v, m), abs_tol=1e-12), (pp, v, m)


# ---------------------------------------------------------------------------- the cache
def test_cache_holds_each_block_once():
    cache = BlockCache(trace=True)
    block = torch.ones(2, 3)
    cache.put(0, 0, block)
    with pytest.raises(BlockCacheError, match="already cached"):
        cache.put(0, 0, block.clone())
    leaves = cache.leaves(0, 1)
    assert leaves[0].data_ptr() == block.data_ptr() and leaves[0].requires_grad
    cache.accumulate(0, 0, torch.ones(2, 3))
    with pytest.raises(BlockCacheError, match="undelivered gradient"):
        cache.release(0, [0])
    cache.put(1, 0, block)
    assert cache.live == 2 and cache.peak == 2
    assert cache.pop_grad(1, 0) is None
    cache.release(1, [0])
    cache.finish(1)
    assert cache.live == 1
    with pytest.raises(BlockCacheError, match="not cached"):
        cache.value(1, 0)


# ---------------------------------------------------------------------------- executor, one process
def test_single_stage_schedule_is_gradient_accumulation():
    """pp = 1: the schedule runs F/B per micro-batch; loss and gradients are the full batch's."""
    config = ModelConfig(
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=64,
        num_experts=4,
        num_experts_per_token=2,
        moe_intermediate_size=16,
        routed_expert_hidden_size=16,
    )
    reference = K3ModelChunk(config).double()
    reference.init_weights(5)
    model = K3ModelChunk(config).double()
    model.init_weights(5)
    tokens = torch.randint(0, config.vocab_size, (4, 9), generator=torch.Generator().manual_seed(0))
    expected = reference.loss(reference(tokens[:, :-1]), tokens[:, 1:])
    expected.backward()

    plan = PipelinePlan.build(2, 1, 1, config.attn_res, config.attn_res_block_size)
    group = Group("pp", (0,), 0, None, TrafficCounter())
    schedule = PipelineExecutor(plan, group, residual_shape(2, 8, config.hidden_size), dtype=torch.float64)
    loss = schedule.run([model], list(tokens.split(2)))
    assert abs(loss.item() - expected.item()) < 1e-12
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if q.grad is None:
            assert p.grad is None, name
        else:
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-12, msg=name)
    assert schedule.stats.steps == 4 and group.counter.snapshot() == {}
    assert schedule.run([model], list(tokens.split(2)), forward_only=True).item() == pytest.approx(
        expected.item(), abs=1e-12
    )


@pytest.mark.parametrize("pp,v,m", [(2, 1, 3), (4, 1, 6), (2, 2, 4), (4, 2, 8), (3, 3, 6), (4, 4, 4)])
def test_peers_post_messages_in_the_same_order(pp, v, m):
    """Per (sender, receiver, direction) the sender's sends and the receiver's receives follow the
    same (hop, micro-batch) order, as a tag-less backend (NCCL) needs. With P > 2 forward and
    backward messages never share a direction between two ranks, so one group suffices there."""
    plan = PipelinePlan.build(pp * v, pp, v, "block", 1)
    sends, receives = {}, {}
    for rank in range(pp):
        for step in schedule_steps(pp, v, rank, m):
            c = plan.chunk_index(rank, step.virtual_stage)
            if step.kind == "forward":
                if c > 0:
                    receives.setdefault((plan.rank_of(c - 1), rank, "forward"), []).append((c - 1, step.micro_batch))
                if c < plan.num_chunks - 1:
                    sends.setdefault((rank, plan.rank_of(c + 1), "forward"), []).append((c, step.micro_batch))
            else:
                if c < plan.num_chunks - 1:
                    receives.setdefault((plan.rank_of(c + 1), rank, "backward"), []).append((c, step.micro_batch))
                if c > 0:
                    sends.setdefault((rank, plan.rank_of(c - 1), "backward"), []).append((c - 1, step.micro_batch))
    assert sends == receives
    if pp > 2:
        directions = {}
        for sender, receiver, kind in sends:
            directions.setdefault((sender, receiver), set()).add(kind)
        assert all(len(kinds) == 1 for kinds in directions.values())
