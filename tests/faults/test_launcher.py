"""tools/launch.py: torchrun's agent, but the job's endings (docs/failures.md) come out as the
ranks made them: Ctrl-C saves and exits 3 with one stdout line and nothing on stderr, an error
is one line and status 2, a killed rank is one line from the launcher. Plain torchrun's own
reports (a traceback and a summary, status 1) are in test_job_faults.py."""

from __future__ import annotations

import os
import signal

import pytest

from tests.faults.harness import complete_checkpoints, launched

pytest.importorskip("torch")
pytestmark = pytest.mark.timeout(300)
STOPPED, ERROR = 3, 2


def non_empty(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def test_ctrl_c_saves_and_exits_stopped_with_one_line(tmp_path):
    run_dir = tmp_path / "ctrl-c"
    job = launched(run_dir, "checkpoint.interval=0")
    job.wait_for(r"step 2/6")
    os.killpg(job.process.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the launcher's process group
    assert job.finish() == STOPPED, job.stdout[-2000:] + job.stderr[-3000:]
    stopped = [line for line in job.stdout.splitlines() if line.startswith("stopped at step")]
    assert len(stopped) == 1 and "(SIGINT)" in stopped[0], job.stdout[-2000:]
    assert non_empty(job.stderr) == [], job.stderr[-3000:]
    assert complete_checkpoints(run_dir) == [int(stopped[0].split()[3])]


def test_sigterm_to_the_launcher_is_forwarded_and_exits_stopped(tmp_path):
    run_dir = tmp_path / "sigterm"
    job = launched(run_dir, "checkpoint.interval=0")
    job.wait_for(r"step 2/6")
    job.signal(signal.SIGTERM)  # a scheduler signals the launcher alone
    assert job.finish() == STOPPED, job.stdout[-2000:] + job.stderr[-3000:]
    assert "(SIGTERM)" in job.stdout and non_empty(job.stderr) == [], job.stderr[-3000:]


def test_a_job_error_is_one_line_with_its_status(tmp_path):
    missing = tmp_path / "no-such-data"
    job = launched(tmp_path / "error", f"data.paths=[{missing}]")
    assert job.finish() == ERROR, job.stderr[-3000:]
    lines = non_empty(job.stderr)
    assert len(lines) == 1 and lines[0].startswith("error:") and str(missing) in lines[0], job.stderr[-3000:]


def test_a_killed_rank_is_one_line_from_the_launcher(tmp_path):
    job = launched(tmp_path / "killed", "checkpoint.interval=0")
    job.wait_for(r"step 2/6")
    from tools.launch import child_processes

    ranks = child_processes(job.process.pid)
    assert len(ranks) == 2
    os.kill(ranks[-1], signal.SIGKILL)
    code = job.finish()
    lines = [line for line in non_empty(job.stderr) if line.startswith("error:")]
    assert code == 128 + signal.SIGKILL, job.stderr[-3000:]
    # The launcher's line; rank 0 may add its own (its next collective lost the peer: status 5).
    assert [line for line in lines if "was killed by SIGKILL" in line] and len(lines) <= 2, job.stderr[-3000:]
    assert "Traceback" not in job.stderr, job.stderr[-3000:]
