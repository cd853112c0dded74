"""`pretrain_k3.py` under DP×TP on gloo reproduces the single-process losses, and checkpoints
saved under DP2×TP2 resume under TP4 and on one process with the same next-step loss.

Tolerance: the model runs in fp32 and the layouts sum partial results (TP row-parallel outputs,
DP gradient averages) in different orders, so losses agree to fp32 rounding amplified over a few
optimizer steps: 2e-5 absolute on losses of about 6 (a wrong reduction is off by >1e-2).
"""

import json
import pathlib

from tests.distributed.harness import CHECKOUT, run_workers

TOLERANCE = 2e-5
SMALL = ["data.seq_length=32", "train.global_batch_size=4", "train.micro_batch_size=1", "train.eval_interval=0",
         "schedule.warmup_steps=1", "logging.jsonl=true", "train.device=cpu"]


def losses(run_dir: pathlib.Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def pretrain(world_size: int, run_dir: pathlib.Path, *overrides: str) -> None:
    argv = ["--recipe", str(CHECKOUT / "recipes/debug.yaml"), "--run-dir", str(run_dir), *SMALL, *overrides]
    codes = run_workers(world_size, "tests.distributed.workers_pretrain:run_pretrain", argv, timeout_s=420)
    assert codes == [0] * world_size, codes


def test_dp_tp_training_matches_single_process_and_checkpoints_reshard(tmp_path):
    single, parallel = tmp_path / "single", tmp_path / "dp2tp2"
    pretrain(1, single, "train.steps=3")
    pretrain(4, parallel, "train.steps=3", "parallel.tp=2", "parallel.dp=2", "parallel.sequence_parallel=true",
             "checkpoint.interval=2")
    reference, measured = losses(single), losses(parallel)
    assert sorted(measured) == [1, 2, 3]
    for step in (1, 2, 3):
        assert abs(measured[step] - reference[step]) < TOLERANCE, (step, measured, reference)

    checkpoint = parallel / "checkpoints" / "step_00000002"
    for world_size, layout in ((4, ["parallel.tp=4", "parallel.dp=1"]), (1, [])):
        resumed = tmp_path / f"resumed-{world_size}"
        pretrain(world_size, resumed, "train.steps=3", f"checkpoint.resume={checkpoint}", *layout)
        assert sorted(losses(resumed)) == [3]
        assert abs(losses(resumed)[3] - measured[3]) < TOLERANCE, (world_size, losses(resumed), measured)
