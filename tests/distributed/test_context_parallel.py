"""Context parallelism reproduces the single-process loss, gradients and balancer biases (gloo, CPU).

Two launches (2 and 4 ranks) run every layout in tests/distributed/workers_context.py: one
step of the job's own build (`build_rank`: model, gradient reducer over dp × cp, pipeline
schedule) in float64 against one process on the whole global batch. The KDA chunk is 8 tokens,
so sequence lengths both are and are not multiples of chunk × cp (pieces of 6, 8 and 4 tokens,
one piece shorter than a chunk, one exactly a chunk).

Tolerance: 1e-12 absolute on the loss (≈ 5.6) and on every gradient (O(1e-2)): the CP model
computes the same sums in a different association (states through the pieces' affine maps,
attention over gathered keys), so differences are a few ulps (measured: below 6e-16).

The layout rules and the planner's cp terms need no processes and are checked here too; the
last test runs `pretrain_k3.py` itself under cp (five short launches).
"""

import pytest

from k3train.parallel.config import LayoutError, ModelSplitSizes, check_context_split
from k3train.parallel.state import layout_of, resolve_layout
from tests.distributed.harness import run_workers

TOLERANCE = 1e-12

TWO_RANKS = [
    dict(name="cp2, seq 32 (multiple of chunk*cp)", cp=2, seq=32, global_batch=2, micro_batch=1),
    dict(name="cp2, seq 24 (pieces of 6 < chunk)", cp=2, seq=24, global_batch=2, micro_batch=2),
    dict(name="cp2, seq 24, states gathered", cp=2, seq=24, global_batch=2, micro_batch=1, state_exchange="gather"),
]
FOUR_RANKS = [
    dict(name="cp4, seq 32 (pieces of 4)", cp=4, seq=32, global_batch=2, micro_batch=1),
    dict(name="cp4, seq 64 (pieces of one chunk)", cp=4, seq=64, global_batch=1, micro_batch=1),
    dict(name="cp4, seq 32, states gathered", cp=4, seq=32, global_batch=2, micro_batch=1, state_exchange="gather"),
    dict(name="cp2 x dp2, seq 24", cp=2, seq=24, global_batch=4, micro_batch=1),
    dict(name="cp2 x tp2 + sp, seq 32", cp=2, tp=2, sp=True, seq=32, global_batch=2, micro_batch=1),
    dict(name="cp2 x pp2, seq 32, 2 micro-batches", cp=2, pp=2, seq=32, global_batch=4, micro_batch=2),
    dict(name="cp2 x pp2, states gathered", cp=2, pp=2, seq=32, global_batch=4, micro_batch=2, state_exchange="gather"),
    dict(name="cp2 x ep2, seq 24", cp=2, ep=2, seq=24, global_batch=4, micro_batch=1),
    dict(name="cp2 x ep2 x tp2 + sp, seq 24", cp=2, ep=2, tp=2, sp=True, seq=24, global_batch=2, micro_batch=1),
]


def check(results: list[list[dict]]) -> None:
    for rank, per_layout in enumerate(results):
        for result in per_layout:
            label = (result["name"], rank)
            assert abs(result["loss"] - result["reference_loss"]) < TOLERANCE, (label, result)
            assert result["max_grad_error"] < TOLERANCE, (label, result["worst_param"], result["max_grad_error"])
            assert result["bias_error"] < TOLERANCE, (label, result["bias_error"])
            assert result["checked"] > 40, label
            assert result["cp_bytes"] > 0, label  # the pieces did cross ranks
            assert result["cp_bytes"] == result["planned_cp_bytes"], label  # the planner's formula
    print({result["name"]: (result["max_grad_error"], result["cp_bytes"]) for result in results[0]})


def test_context_parallel_two_ranks():
    check(run_workers(2, "tests.distributed.workers_context:run_checks", TWO_RANKS, timeout_s=300))


def test_context_parallel_combined_with_dp_tp_pp_ep():
    check(run_workers(4, "tests.distributed.workers_context:run_checks", FOUR_RANKS, timeout_s=480))


DEBUG_MODEL = ModelSplitSizes(mla_heads=4, kda_heads=4, vocab_size=384, num_experts=16, num_layers=8)


def test_rank_order_puts_cp_between_tp_and_dp():
    layout = resolve_layout(16, 2, 2, 0, 1, 1, DEBUG_MODEL, cp=2)
    assert (layout.dp, layout.data_parallel, layout.cp) == (4, 2, 2)  # replicas = data × cp
    assert layout.cp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert layout.tp_groups()[0] == [0, 1]
    assert layout.dp_groups()[0] == [0, 2, 4, 6]  # gradients averaged over data × cp
    assert layout.pp_groups()[0] == [0, 8]
    assert sorted(r for group in layout.cp_groups() for r in group) == list(range(16))


@pytest.mark.parametrize(
    "args,message",
    [
        (dict(world=6, cp=4), "not divisible by tp\\*pp\\*cp"),
        (dict(world=8, cp=2, dp=3), "parallel.dp=3"),
    ],
)
def test_impossible_layouts_say_what_fits(args, message):
    with pytest.raises(LayoutError, match=message):
        resolve_layout(args["world"], 1, 1, args.get("dp", 0), 1, 1, DEBUG_MODEL, cp=args["cp"])


@pytest.mark.parametrize(
    "cp,seq,tp,sp,message",
    [
        (2, 30, 1, False, "does not split into 2\\*parallel.cp = 4"),
        (4, 16, 1, False, "fewer than the short convolution's tail of 3"),
        (2, 12, 4, True, "not divisible by parallel.tp=4"),
    ],
)
def test_sequence_lengths_that_cannot_split(cp, seq, tp, sp, message):
    with pytest.raises(LayoutError, match=message):
        check_context_split(cp, seq, 4, tp, sp)
    check_context_split(cp, seq * 4 * tp, 4, tp, sp)  # a longer sequence splits


def test_planner_counts_a_rank_s_share_of_the_sequence():
    """Under cp = 2 a rank keeps fewer activations (its half of the tokens, plus MLA's gathered
    keys) and sends the cp exchanges; the k3-long recipe resolves for its stated 2048 GPUs."""
    import pathlib

    from k3train.config import load_config
    from k3train.planning.layout_traffic import layout_step_bytes
    from k3train.planning.memory import rank_memory
    from k3train.training.build import build_planning_rank

    checkout = pathlib.Path(__file__).resolve().parents[2]
    memories, traffic = {}, {}
    for cp in (1, 2):
        config = load_config(str(checkout / "recipes" / "debug.yaml"), [f"parallel.cp={cp}"])
        m = config.model
        layout = resolve_layout(2 * cp, 1, 1, 2, 1, 1, ModelSplitSizes.of(m), cp=cp)
        job = build_planning_rank(config, layout, 0)
        memories[cp] = rank_memory(job, layout, micro_batches=2).activations
        traffic[cp] = layout_step_bytes(job, micro_batches=2)
    assert memories[1] / 2 < memories[2] < memories[1]
    assert "cp" not in traffic[1] and traffic[2]["cp"] > 0

    long = load_config(str(checkout / "recipes" / "k3-long.yaml"), [])
    p, m = long.parallel, long.model
    layout = layout_of(2048, p, m)
    assert (layout.cp, layout.data_parallel, long.data.seq_length // layout.cp) == (8, 2, 16384)


def test_pretrain_with_context_parallelism_matches_one_process_and_resumes_across_cp(tmp_path):
    """`pretrain_k3.py` itself (fp32, the tolerance of tests/distributed/test_pretrain_parallel.py:
    2e-5 on losses of about 6): cp2 × dp2 and cp2 against one process, cp2's evaluation too (with
    one data rank it reads the same validation rows); cp2 × dp2's step-2 checkpoint resumed
    under cp4 and on one process gives the same step-3 loss."""
    import json

    from tests.distributed.test_pretrain_parallel import assert_close, pretrain

    def validation_loss(run_dir):
        lines = [line for line in (run_dir / "metrics.jsonl").read_text().splitlines() if "validation_loss" in line]
        assert len(lines) == 1, lines
        return json.loads(lines[0])["validation_loss"]

    reference = pretrain(1, tmp_path / "single", "train.eval_interval=3")
    measured_dir = tmp_path / "cp2dp2"
    measured = pretrain(4, measured_dir, "parallel.cp=2", "parallel.dp=2")
    assert_close(measured, reference, [1, 2, 3])
    context_only = pretrain(2, tmp_path / "cp2", "parallel.cp=2", "train.eval_interval=3")
    assert_close(context_only, reference, [1, 2, 3])
    assert abs(validation_loss(tmp_path / "cp2") - validation_loss(tmp_path / "single")) < 2e-5
    checkpoint = measured_dir / "checkpoints" / "step_00000002"
    for world_size, layout in ((4, ["parallel.cp=4", "parallel.dp=1"]), (1, [])):
        resumed = pretrain(world_size, tmp_path / f"resumed-{world_size}", f"checkpoint.resume={checkpoint}", *layout)
        assert_close(resumed, measured, [3])
