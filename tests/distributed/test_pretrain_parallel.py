"""`pretrain_k3.py` under parallel layouts on gloo reproduces the single-process losses, and
checkpoints saved under one layout resume under another with the same next-step loss.

Tolerance: the model runs in fp32 and the layouts sum partial results (TP row-parallel outputs,
DP gradient averages, expert combines) in different orders, so losses agree to fp32 rounding
amplified over a few optimizer steps: 2e-5 absolute on losses of about 6 (a wrong reduction or
a lost block representation is off by more than 1e-2).
"""

import json
import pathlib

import pytest

from tests.distributed.harness import CHECKOUT, run_workers

TOLERANCE = 2e-5
# Validation at step 3 runs the same 4 x 4 validation rows under every layout. Newton–Schulz in
# fp32: in bf16 (the default for the debug model's larger matrices where a CPU measured bf16
# faster, as on GPUs)
# the layouts' ~1e-7 differences in the momenta would flip bf16 roundings (2^-8) and the losses
# would differ by ~1e-4, whatever the layouts compute.
SMALL = [
    "data.seq_length=32",
    "train.global_batch_size=4",
    "train.micro_batch_size=1",
    "train.eval_interval=3",
    "schedule.warmup_steps=1",
    "train.device=cpu",
    "train.steps=3",
    "checkpoint.interval=2",
    "optimizer.newton_schulz_dtype=float32",
]


def losses(run_dir: pathlib.Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r and "validation_loss" not in r}


def validation_loss(run_dir: pathlib.Path) -> float:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (loss,) = [r["validation_loss"] for r in records if "validation_loss" in r]
    return loss


def pretrain(world_size: int, run_dir: pathlib.Path, *overrides: str) -> dict[int, float]:
    argv = ["--recipe", str(CHECKOUT / "recipes/debug.yaml"), "--run-dir", str(run_dir), *SMALL, *overrides]
    codes = run_workers(world_size, "tests.distributed.workers_pretrain:run_pretrain", argv, timeout_s=420)
    assert codes == [0] * world_size, codes
    return losses(run_dir)


def assert_close(measured: dict[int, float], reference: dict[int, float], steps) -> None:
    assert sorted(measured) == list(steps), measured
    for step in steps:
        assert abs(measured[step] - reference[step]) < TOLERANCE, (step, measured, reference)


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> tuple[pathlib.Path, dict[int, float]]:
    run_dir = tmp_path_factory.mktemp("single")
    return run_dir, pretrain(1, run_dir)


def test_dp_tp_sp_matches_single_process_and_reshards_to_tp4_and_one_process(single, tmp_path):
    reference = single[1]
    parallel = tmp_path / "dp2tp2"
    measured = pretrain(4, parallel, "parallel.tp=2", "parallel.dp=2", "parallel.sequence_parallel=true")
    assert_close(measured, reference, [1, 2, 3])
    assert abs(validation_loss(parallel) - validation_loss(single[0])) < TOLERANCE
    checkpoint = parallel / "checkpoints" / "step_00000002"
    for world_size, layout in ((4, ["parallel.tp=4", "parallel.dp=1"]), (1, [])):
        resumed = pretrain(world_size, tmp_path / f"resumed-{world_size}", f"checkpoint.resume={checkpoint}", *layout)
        assert_close(resumed, measured, [3])


def test_interleaved_pipeline_matches_single_process_and_reshards_both_ways(single, tmp_path):
    single_dir, reference = single
    pipelined = tmp_path / "pp4v2"
    measured = pretrain(4, pipelined, "parallel.pp=4", "parallel.virtual_stages=2")
    assert_close(measured, reference, [1, 2, 3])
    # evaluation through the interleaved schedule: the same validation rows and loss
    assert abs(validation_loss(pipelined) - validation_loss(single_dir)) < TOLERANCE
    # Saved under PP4×V2, resumed on one process; saved on one process, resumed under PP2.
    resumed = pretrain(1, tmp_path / "pp-to-1", f"checkpoint.resume={pipelined / 'checkpoints' / 'step_00000002'}")
    assert_close(resumed, measured, [3])
    resumed = pretrain(
        2, tmp_path / "1-to-pp", f"checkpoint.resume={single_dir / 'checkpoints' / 'step_00000002'}", "parallel.pp=2"
    )
    assert_close(resumed, reference, [3])


def test_expert_parallel_with_data_parallel_matches_single_process(single, tmp_path):
    run_dir = tmp_path / "ep2dp4"
    measured = pretrain(4, run_dir, "parallel.ep=2")  # dp=4 > micro_batch_size; ep_transport auto: splits
    assert_close(measured, single[1], [1, 2, 3])
    assert abs(validation_loss(run_dir) - validation_loss(single[0])) < TOLERANCE
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["dropped_tokens"] == 0 for r in records if "dropped_tokens" in r)
