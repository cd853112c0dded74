"""Failures a user's input causes end in one line, never a traceback: impossible config values
(checked before torch loads) and a save that fails. Also the pieces the job's fault handling is
built from: the stop watchdog, the collective-failure line, the test-only NaN hook's parser."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.faults.harness import CHECKOUT, complete_checkpoints, single


@pytest.mark.parametrize(
    "override, expected",
    [
        ("train.micro_batch_size=0", "train.micro_batch_size must be at least 1, got 0"),
        ("optimizer.lr=.nan", "optimizer.lr must be a finite number, got nan"),
        ("optimizer.lr=.inf", "optimizer.lr must be a finite number, got inf"),
        ("parallel.collective_timeout_s=-1", "parallel.collective_timeout_s must be 0"),
        ("train.stop_grace_s=0", "train.stop_grace_s must be a positive number"),
        ("model.linear_attn_config.chunk_size=0", "model.linear_attn_config.chunk_size must be at least 1, got 0"),
        ("model.kv_lora_rank=0", "model.kv_lora_rank must be at least 1, got 0"),
        ("model.num_shared_experts=-1", "model.num_shared_experts must not be negative, got -1"),
        ("optimizer.clip_grad=-1", "optimizer.clip_grad must not be negative, got -1.0"),
        ("model.num_experts_per_token=0", "model.num_experts_per_token must lie in [1, model.num_experts)"),
    ],
)
def test_impossible_value_is_one_line(tmp_path, override, expected):
    result = subprocess.run(
        [
            sys.executable,
            str(CHECKOUT / "pretrain_k3.py"),
            "--recipe",
            str(CHECKOUT / "recipes/debug.yaml"),
            "--run-dir",
            str(tmp_path),
            override,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=CHECKOUT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1 and expected in lines[0], result.stderr


def test_micro_batches_per_rank_refuses_zero_instead_of_dividing():
    from k3train.config import ConfigError
    from k3train.training.config import TrainConfig

    with pytest.raises(ConfigError, match="at least 1"):
        TrainConfig(micro_batch_size=0).micro_batches_per_rank(1)


def test_failed_save_is_one_line_saying_what_was_kept(tmp_path):
    """The checkpoint directory is replaced by a file while the job runs: the save fails, the job
    ends with one line (status 2) saying which save failed and that no checkpoint is kept."""
    pytest.importorskip("torch")
    run_dir = tmp_path / "save-fails"
    checkpoints = tmp_path / "checkpoints"
    # The first save at step 4: three steps between the line and the save leave time to swap the
    # directory for a file even on a loaded machine (step 2 followed within milliseconds).
    job = single(run_dir, f"checkpoint.dir={checkpoints}", "checkpoint.resume=none", "checkpoint.interval=4")
    job.wait_for(r"step 1/6")
    shutil.rmtree(checkpoints)  # with the job's lock file in it
    checkpoints.write_text("not a directory")
    assert job.finish() == 2, job.stderr[-3000:]
    lines = job.error_lines()
    assert len(lines) == 1 and "Traceback" not in job.stderr, job.stderr[-3000:]
    assert "saving the checkpoint of step 4" in lines[0] and "no complete checkpoint is kept" in lines[0], lines[0]
    assert complete_checkpoints(run_dir) == []


# ------------------------------------------------------------------ the pieces, in process


def _watched(grace_s: float):
    from k3train.job.signals import GracefulExit

    calls: list[tuple[int, str]] = []
    done = threading.Event()

    def unanswered(signum: int, reason: str) -> None:
        calls.append((signum, reason))
        done.set()

    return GracefulExit(grace_s=grace_s, on_unanswered=unanswered), calls, done


def test_stop_watchdog_fires_when_the_loop_does_not_answer_within_the_grace():
    stop, calls, done = _watched(grace_s=0.5)
    with stop:
        os.kill(os.getpid(), signal.SIGTERM)
        assert done.wait(10)  # the loop never calls requested(): the watchdog ends the wait
    assert calls and calls[0][0] == signal.SIGTERM and "within 0.5s" in calls[0][1]


def test_stop_watchdog_stands_down_once_the_loop_acknowledges():
    stop, calls, done = _watched(grace_s=0.5)
    with stop:
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while not stop.requested() and time.monotonic() < deadline:  # the loop's check: acknowledges
            time.sleep(0.01)
        assert not done.wait(1.5)
    assert calls == []


def test_stop_watchdog_fires_on_a_second_signal_even_after_acknowledging():
    stop, calls, done = _watched(grace_s=60)
    with stop:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
        assert stop.requested()
        time.sleep(1.2)  # later than a launcher's forwarded copy of the same signal
        os.kill(os.getpid(), signal.SIGTERM)
        assert done.wait(10)
    assert "twice" in calls[0][1]


def test_collective_failure_line_names_group_operation_and_timeout():
    pytest.importorskip("torch")
    from k3train.parallel.comm import TrafficCounter, describe_collective_failure

    counter = TrafficCounter()
    counter.note("dp", "all_reduce")
    timed_out = RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
        "5000ms for recv operation to complete"
    )
    assert describe_collective_failure(timed_out, counter, 5.0).startswith(
        "collective all_reduce on group 'dp' timed out after 5s (a rank stopped answering?)"
    )
    closed = RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1"
    )
    assert "closed its connection" in describe_collective_failure(closed, counter, 5.0)
    # what gloo raises from an asynchronous collective's work.wait() (the gradient buckets)
    pair_closed = RuntimeError("Application timeout caused pair closure")
    assert describe_collective_failure(pair_closed, counter, 5.0).startswith(
        "collective all_reduce on group 'dp' timed out after 5s"
    )
    assert describe_collective_failure(RuntimeError("CUDA out of memory"), counter, 5.0) is None
    assert describe_collective_failure(ValueError("bad"), counter, 5.0) is None


def test_nan_gradient_hook_parses_only_its_test_syntax():
    pytest.importorskip("torch")
    from k3train.training.loop import TrainingError, nan_gradient_steps

    assert nan_gradient_steps(None, 0) == frozenset()
    assert nan_gradient_steps("1:3,4", 1) == {3, 4}
    assert nan_gradient_steps("1:3,4", 0) == frozenset()
    with pytest.raises(TrainingError, match="RANK:STEP"):
        nan_gradient_steps("3", 0)
