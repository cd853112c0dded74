"""pretrain_k3.py with bf16 weights and fp32 master shards: it trains, a resume continues bit for
bit (the masters come back from the optimizer state), a checkpoint of fp32 weights (no masters)
is refused, and an fp32 forward is refused at load."""

import shutil

from tests.e2e.test_pretrain import SMALL, losses, run_pretrain

MIXED = ["train.precision=bf16", "train.weights=bf16_with_fp32_master_shards"]


def test_resume_with_master_shards_continues_bit_identically(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    common = [*SMALL, *MIXED, "train.steps=4", "checkpoint.interval=2", "checkpoint.keep_last=0"]
    result = run_pretrain("--run-dir", str(first), *common)
    assert result.returncode == 0, result.stderr[-3000:]
    (second / "checkpoints").mkdir(parents=True)
    shutil.copytree(first / "checkpoints" / "step_00000002", second / "checkpoints" / "step_00000002")
    result = run_pretrain("--run-dir", str(second), *common)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stdout
    full, resumed = losses(first), losses(second)
    assert resumed == {3: full[3], 4: full[4]}, (full, resumed)
    assert full[4] < full[1]


def test_fp32_checkpoint_is_refused_by_a_master_shard_run(tmp_path):
    """A checkpoint written with fp32 weights holds no masters: the run says which entries are
    missing rather than starting its masters from anything else."""
    run_dir = tmp_path / "run"
    common = [*SMALL, "train.precision=bf16", "train.steps=2", "checkpoint.interval=2"]
    result = run_pretrain("--run-dir", str(run_dir), *common)
    assert result.returncode == 0, result.stderr[-3000:]
    result = run_pretrain("--run-dir", str(run_dir), *[*common[:-2], "train.steps=3"], *MIXED)
    assert result.returncode != 0
    assert "missing in the checkpoint" in result.stderr and ".master_weight" in result.stderr


def test_master_shards_need_a_bf16_forward():
    result = run_pretrain("--run-dir", "/nonexistent", "train.weights=bf16_with_fp32_master_shards")
    assert result.returncode != 0
    assert "train.weights=bf16_with_fp32_master_shards runs the forward in bf16" in result.stderr
