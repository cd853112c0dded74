"""Stops the launcher and the operating system send: SIGHUP is a stop like SIGTERM; under
torchrun the grace fits inside the agent's SIGTERM-to-SIGKILL window, so a rank blocked on a
frozen peer still says why it did not save; and a non-finite step never saves over finite ones."""

from __future__ import annotations

import os
import pathlib
import signal
import time

import pytest

from k3train.job.signals import launcher_grace
from tests.faults.harness import complete_checkpoints, launch, single

pytest.importorskip("torch")
STOPPED, STOPPED_UNSAVED = 3, 4


def test_sighup_stops_with_a_save_like_sigterm(tmp_path):
    run_dir = tmp_path / "hangup"
    job = single(run_dir, "checkpoint.interval=0")
    job.wait_for(r"step 2/6")
    job.signal(signal.SIGHUP)
    assert job.finish() == STOPPED, job.stderr[-3000:]
    stopped = [line for line in job.stdout.splitlines() if line.startswith("stopped at step")]
    assert len(stopped) == 1 and "(SIGHUP)" in stopped[0], job.stdout[-2000:]
    assert complete_checkpoints(run_dir) == [int(stopped[0].split()[3])]


def test_a_non_finite_step_does_not_rotate_out_a_finite_checkpoint(tmp_path):
    """Step 4 is skipped (NaN gradients): its periodic save is skipped too, so with keep_last=1
    the step-2 checkpoint stays the one kept."""
    run_dir = tmp_path / "nan"
    job = single(
        run_dir,
        "train.steps=4",
        "checkpoint.keep_last=1",
        "train.max_nonfinite_steps=3",
        env_extra={"K3TRAIN_TEST_NAN_GRAD": "0:4"},
    )
    assert job.finish() == 0, job.stderr[-3000:]
    assert "checkpoint skipped at step 4: the step was not finite" in job.stdout, job.stdout[-2000:]
    assert complete_checkpoints(run_dir) == [2]


def test_the_grace_fits_torchruns_window():
    assert launcher_grace(60.0, {}) == (60.0, None)  # no launcher: the configured grace
    grace, line = launcher_grace(60.0, {"TORCHELASTIC_RUN_ID": "x"})
    assert grace == 20.0 and line is not None and "30s to SIGKILL" in line
    assert launcher_grace(20.0, {"TORCHELASTIC_RUN_ID": "x"}) == (20.0, None)  # the default fits
    assert launcher_grace(20.0, {"TORCHELASTIC_RUN_ID": "x", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "8"})[0] == 4.0


def _ranks_of(agent_pid: int, timeout_s: float = 120) -> dict[int, int]:
    """{rank: pid} of a torchrun agent's workers, from their environment."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = {}
        children = pathlib.Path(f"/proc/{agent_pid}/task/{agent_pid}/children").read_text().split()
        for child in children:
            try:
                environ = pathlib.Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            for item in environ:
                if item.startswith(b"RANK="):
                    found[int(item[5:])] = int(child)
        if len(found) == 2:
            return found
        time.sleep(0.2)
    raise AssertionError("torchrun's workers did not appear")


@pytest.mark.skipif(not pathlib.Path("/proc/self/task").exists(), reason="needs /proc")
def test_sigterm_to_torchrun_with_a_frozen_rank_says_why_before_the_sigkill(tmp_path):
    from tests.faults.harness import job_args

    run_dir = tmp_path / "frozen"
    agent = launch(
        ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
        + job_args(run_dir, "parallel.collective_timeout_s=600", "train.stop_grace_s=60"),
        run_dir.parent / "logs",
        "frozen.torchrun",
        env_extra={"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "8"},
    )
    try:
        agent.wait_for(r"checkpoint saved: .*step_00000002")
        assert "train.stop_grace_s=60 is longer than torchrun allows" in agent.stdout
        ranks = _ranks_of(agent.process.pid)
        os.kill(ranks[1], signal.SIGSTOP)
        time.sleep(1)
        agent.signal(signal.SIGTERM)
        agent.finish(timeout_s=90)
    finally:
        agent.kill()
    lines = [line for line in agent.stderr.splitlines() if line.startswith("error: stopped at step")]
    assert lines and "without saving" in lines[0] and "within 4s" in lines[0], agent.stderr[-3000:]
