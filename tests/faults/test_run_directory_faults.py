"""One job per run directory: a second job on a live job's run directory is refused with one
line naming the holder, and touches nothing there. (A killed job's stale lock being taken over
is asserted by test_job_faults.py's kill -9 scenario.)"""

from __future__ import annotations

import os
import signal

import pytest

from k3train.checkpoint.manifest import complete_checkpoints
from k3train.job.run_lock import LOCK_NAME
from tests.faults.harness import STEPS, single

pytest.importorskip("torch")
ERROR = 2


def steps_kept(run_dir) -> list[int]:
    return [step for step, _ in complete_checkpoints(run_dir / "checkpoints")]


def test_second_job_on_a_live_run_directory_is_refused_and_the_first_finishes(tmp_path):
    run_dir = tmp_path / "shared"
    first = single(run_dir)
    first.wait_for(r"checkpoint saved: .*step_00000002")
    os.kill(first.process.pid, signal.SIGSTOP)  # alive but still: the second job meets it mid-run
    try:
        # What an interrupted save of the first job looks like to a start-up's cleaning.
        in_progress = run_dir / "checkpoints" / ".tmp_step_00000004_0123abcd"
        in_progress.mkdir()
        (in_progress / ".metadata.tmp").write_bytes(b"being written")
        second = single(run_dir, "optimizer.lr=1.0e-2", "checkpoint.resume=auto")
        assert second.finish() == ERROR, second.stderr[-3000:]
        lines = second.error_lines()
        assert len(lines) == 1 and "Traceback" not in second.stderr, second.stderr[-3000:]
        assert f"is in use by another job (pid {first.process.pid} on host" in lines[0], lines[0]
        assert "--run-dir" in lines[0], lines[0]
        assert (in_progress / ".metadata.tmp").exists()  # nothing of the first job's was cleaned
        assert "resumed from" not in second.stdout
    finally:
        os.kill(first.process.pid, signal.SIGCONT)
    assert first.finish() == 0, first.stderr[-3000:]
    assert f"done: step {STEPS}" in first.stdout
    assert steps_kept(run_dir) == [2, 4, 6]
    assert "lr: 0.003" in (run_dir / "config.yaml").read_text()  # the first job's, not overwritten
    assert not (run_dir / LOCK_NAME).exists()  # released on the way out
