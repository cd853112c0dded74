"""The job under faults: kill -9, SIGTERM under torchrun, NaN gradients on one rank, damaged
data files, a dead rank and a frozen rank. Each asserts how the job ends (exit status and its one
line), that the newest good checkpoint is intact, and where it applies that a resume continues
with losses bit-identical to an uninterrupted run.

Exit statuses (pretrain_k3.py): 0 done, 2 error, 3 stopped by a signal (saved), 4 stopped by a
signal without saving, 5 a peer rank died or stopped answering.
"""

from __future__ import annotations

import os
import pathlib
import signal
import time

import pytest

from tests.faults.harness import (
    STEPS,
    complete_checkpoints,
    finish_all,
    losses,
    single,
    torchrun,
    two_ranks,
)

pytest.importorskip("torch")
STOPPED, STOPPED_UNSAVED, PEER_LOST, ERROR = 3, 4, 5, 2


def assert_one_error_line(stderr: str, *fragments: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def reference_single(tmp_path_factory) -> dict[int, float]:
    """One process, uninterrupted: the losses every single-process resume must reproduce."""
    run_dir = tmp_path_factory.mktemp("single") / "reference"
    job = single(run_dir)
    assert job.finish() == 0, job.stderr[-3000:]
    assert f"done: step {STEPS}" in job.stdout
    return losses(run_dir)


@pytest.fixture(scope="module")
def reference_two(tmp_path_factory) -> dict[int, float]:
    """Two data-parallel ranks, uninterrupted."""
    run_dir = tmp_path_factory.mktemp("two") / "reference"
    codes = finish_all(two_ranks(run_dir))
    assert codes == [0, 0]
    return losses(run_dir)


def assert_resume_matches(
    run_dir: pathlib.Path, reference: dict[int, float], from_step: int, resumed: dict[int, float]
):
    assert sorted(resumed) == list(range(from_step + 1, STEPS + 1)), (from_step, sorted(resumed))
    assert [resumed[s] for s in resumed] == [reference[s] for s in resumed]  # bit-identical


def test_kill_9_mid_step_then_resume(tmp_path, reference_single):
    run_dir = tmp_path / "killed"
    job = single(run_dir)
    job.wait_for(r"step 3/6")  # step 4 is running (its checkpoint comes at its end)
    os.kill(job.process.pid, signal.SIGKILL)
    assert job.finish() == -signal.SIGKILL
    kept = complete_checkpoints(run_dir)
    assert kept and kept[-1] in (2, 4), kept  # 4 only if the step finished before the kill landed
    resumed_dir = tmp_path / "resumed"
    resume = single(resumed_dir, f"checkpoint.dir={run_dir / 'checkpoints'}", "checkpoint.resume=auto")
    assert resume.finish() == 0, resume.stderr[-3000:]
    # kill -9 ran no clean-up: the killed job's lock is stale (its pid is dead) and taken over
    stale = f"taking over the stale lock {run_dir / 'checkpoints' / '.k3train.lock'} of pid {job.process.pid}"
    assert stale in resume.stderr, resume.stderr[-3000:]
    assert_resume_matches(resumed_dir, reference_single, kept[-1], losses(resumed_dir))


def test_sigterm_under_torchrun_saves_exits_stopped_and_resumes(tmp_path, reference_two):
    run_dir = tmp_path / "stopped"
    agent = torchrun(run_dir, "checkpoint.interval=0")
    agent.wait_for(r"step 2/6")
    agent.signal(signal.SIGTERM)  # as a scheduler does: torchrun forwards it to every rank
    agent.finish()
    stopped = [line for line in agent.stdout.splitlines() if line.startswith("stopped at step")]
    assert len(stopped) == 1 and "(SIGTERM)" in stopped[0], agent.stdout[-2000:] + agent.stderr[-3000:]
    step = int(stopped[0].split()[3])
    assert "done:" not in agent.stdout and "error:" not in agent.stderr, agent.stderr[-3000:]
    # torchrun itself ends with its SignalException traceback (its way of reporting the signal);
    # the ranks print none.
    assert agent.stderr.count("Traceback") <= 1 and "SignalException" in agent.stderr, agent.stderr[-3000:]
    assert complete_checkpoints(run_dir) == [step]
    codes = finish_all(two_ranks(run_dir, "checkpoint.interval=0", "checkpoint.resume=auto"))
    assert codes == [0, 0]
    assert_resume_matches(run_dir, reference_two, step, {s: loss for s, loss in losses(run_dir).items() if s > step})


def test_sigterm_stops_with_the_stopped_status(tmp_path):
    run_dir = tmp_path / "sigterm"
    job = single(run_dir, "checkpoint.interval=0")
    job.wait_for(r"step 2/6")
    job.signal(signal.SIGTERM)
    assert job.finish() == STOPPED, job.stderr[-3000:]
    stopped = [line for line in job.stdout.splitlines() if line.startswith("stopped at step")]
    assert len(stopped) == 1 and "(SIGTERM)" in stopped[0] and "done:" not in job.stdout, job.stdout[-2000:]
    assert complete_checkpoints(run_dir) == [int(stopped[0].split()[3])]


SLOW_START_UP = (
    "model.hidden_size=1024",
    "model.num_hidden_layers=48",
    "model.num_experts=64",
    "model.intermediate_size=4096",
    "model.routed_expert_hidden_size=64",
    "model.linear_attn_config.head_dim=32",
    "train.steps=3000",
)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_signal_during_start_up_is_one_line_and_the_unsaved_status(tmp_path, signum):
    """Before the loop there is nothing to save: status 4 and one line, not SIGTERM's or SIGHUP's
    silent death (-15, -1) or Ctrl-C's KeyboardInterrupt traceback."""
    # A model that takes a second or more to build and more steps than could finish: the signal
    # lands in the start-up however late a loaded machine lets this process send it.
    job = single(tmp_path / "early", *SLOW_START_UP)
    job.wait_for(r"run directory:")  # torch is loaded, the model not built yet
    job.signal(signum)
    assert job.finish() == STOPPED_UNSAVED, job.stderr[-3000:]
    line = assert_one_error_line(
        job.stderr, f"stopped by {signal.Signals(signum).name} without saving", "outside the training loop"
    )
    assert "step 1/" not in job.stdout, line


def test_nan_gradients_on_one_rank_skip_then_stop_on_every_rank(tmp_path, reference_two):
    """Rank 1's gradients are NaN in steps 3 and 4: both ranks skip both steps together, and the
    second skip in a row (train.max_nonfinite_steps=2) ends the run with one line; the step-2
    checkpoint resumes bit-exactly."""
    run_dir = tmp_path / "nan"
    ranks = two_ranks(run_dir, "train.max_nonfinite_steps=2", env_extra={"K3TRAIN_TEST_NAN_GRAD": "1:3,4"})
    assert finish_all(ranks) == [ERROR, ERROR]
    assert_one_error_line(ranks[0].stderr, "step 4", "not finite for 2 steps in a row")
    skipped = [line for line in ranks[0].stdout.splitlines() if line.startswith("step 3/6")]
    assert skipped and "grad_norm nan" in skipped[0].lower(), ranks[0].stdout[-2000:]
    assert complete_checkpoints(run_dir) == [2]
    resumed_dir = tmp_path / "nan-resumed"
    codes = finish_all(two_ranks(resumed_dir, f"checkpoint.dir={run_dir / 'checkpoints'}", "checkpoint.resume=auto"))
    assert codes == [0, 0]
    assert_resume_matches(resumed_dir, reference_two, 2, losses(resumed_dir))


def test_dead_rank_makes_the_other_exit_with_one_line(tmp_path):
    run_dir = tmp_path / "dead"
    ranks = two_ranks(run_dir, "parallel.collective_timeout_s=60")
    ranks[0].wait_for(r"checkpoint saved: .*step_00000002")
    os.kill(ranks[1].process.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    codes = finish_all(ranks, timeout_s=90)
    assert codes == [PEER_LOST, -signal.SIGKILL], ranks[0].stderr[-3000:]
    assert time.monotonic() - killed_at < 60  # a closed connection is noticed at once, not at the timeout
    assert_one_error_line(ranks[0].stderr, "rank 0 of 2", "group '", "closed its connection")
    assert complete_checkpoints(run_dir)[-1] >= 2


def test_frozen_rank_makes_the_other_exit_within_the_timeout(tmp_path):
    run_dir = tmp_path / "frozen"
    timeout_s = 15
    ranks = two_ranks(run_dir, f"parallel.collective_timeout_s={timeout_s}")
    ranks[0].wait_for(r"checkpoint saved: .*step_00000002")
    os.kill(ranks[1].process.pid, signal.SIGSTOP)
    frozen_at = time.monotonic()
    try:
        code = ranks[0].finish(timeout_s=timeout_s + 90)
    finally:
        os.kill(ranks[1].process.pid, signal.SIGKILL)
        finish_all(ranks)
    assert code == PEER_LOST, ranks[0].stderr[-3000:]
    assert time.monotonic() - frozen_at < timeout_s + 60
    assert_one_error_line(ranks[0].stderr, "rank 0 of 2", "group '", f"timed out after {timeout_s}s")
    assert complete_checkpoints(run_dir)[-1] >= 2


def test_sigterm_while_blocked_on_a_frozen_rank_exits_within_the_grace(tmp_path):
    """SIGTERM reaches a rank blocked in a collective (its peer is stopped): it cannot finish the
    step, so after train.stop_grace_s it exits unsaved with one line, long before the timeout."""
    run_dir = tmp_path / "blocked"
    ranks = two_ranks(run_dir, "parallel.collective_timeout_s=600", "train.stop_grace_s=3")
    ranks[0].wait_for(r"checkpoint saved: .*step_00000002")
    os.kill(ranks[1].process.pid, signal.SIGSTOP)
    time.sleep(1)
    ranks[0].signal(signal.SIGTERM)
    signalled_at = time.monotonic()
    try:
        code = ranks[0].finish(timeout_s=90)
    finally:
        os.kill(ranks[1].process.pid, signal.SIGKILL)
        finish_all(ranks)
    assert code == STOPPED_UNSAVED, ranks[0].stderr[-3000:]
    assert time.monotonic() - signalled_at < 60
    line = assert_one_error_line(ranks[0].stderr, "(SIGTERM) without saving", "within 3s")
    assert line.startswith("error: stopped at step "), line
    assert complete_checkpoints(run_dir)[-1] >= 2
