"""The job's ending line in torchrun's error file (k3train/job/ending.py): torch's agent
reads it back as the failed rank's message and shows it in its failure summary."""

from k3train.job.ending import write_torchrun_error_file


def test_torchrun_reads_the_line_as_the_failure_message(tmp_path):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    path = tmp_path / "attempt_0" / "0" / "error.json"
    line = "error: data.paths: /x.idx not found; fix data.paths"
    write_torchrun_error_file(line, {"TORCHELASTIC_ERROR_FILE": str(path)})
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(path))
    assert failure.message == line
    assert f"traceback : {line}" in ChildFailedError("pretrain_k3.py", {0: failure}).format_msg()


def test_nothing_is_written_outside_torchrun(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_torchrun_error_file("error: x", {})
    assert list(tmp_path.iterdir()) == []


def test_an_unwritable_error_file_is_not_an_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    write_torchrun_error_file("error: x", {"TORCHELASTIC_ERROR_FILE": str(blocker / "error.json")})


def test_under_torchrun_other_ranks_let_rank_zero_end_first(tmp_path):
    """Rank 1 meets the same error as rank 0 but does not end before the agent stops it (sent
    when rank 0 has ended): ending first, it would get rank 0 stopped before its line."""
    import os
    import signal
    import subprocess
    import sys
    import time

    code = (
        "from k3train.job.ending import exit_same_on_every_rank\n"
        "print('ready', flush=True)\n"
        "exit_same_on_every_rank('error: x; fix y', 2)\n"
    )
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        TORCHELASTIC_RUN_ID="run",
        RANK="1",
        TORCHELASTIC_ERROR_FILE=str(tmp_path / "error.json"),
    )
    with subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as rank:
        try:
            assert rank.stdout.readline() == "ready\n"
            deadline = time.monotonic() + 30
            while not (tmp_path / "error.json").exists() and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(0.2)
            assert rank.poll() is None  # still waiting for rank 0
            rank.send_signal(signal.SIGTERM)  # the agent, once rank 0 has ended
            assert rank.wait(timeout=30) == 2 and rank.stderr.read() == ""
        finally:
            rank.kill()
    env.update(RANK="0")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stderr == "error: x; fix y\n"
