"""The run-directory lock: a live holder refuses, a dead one on this host is stale, one on
another host cannot be checked and refuses; release removes only our own file."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from k3train.errors import RunDirectoryError
from k3train.job.run_lock import LOCK_NAME, RunDirectoryLock, lock_run_directories


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_held_lock_refuses_a_second_holder_naming_the_first(tmp_path):
    first = RunDirectoryLock(tmp_path)
    assert first.acquire() is None
    with pytest.raises(RunDirectoryError, match=rf"in use by another job \(pid {os.getpid()} on host"):
        RunDirectoryLock(tmp_path).acquire()
    first.release()
    assert not (tmp_path / LOCK_NAME).exists()
    second = RunDirectoryLock(tmp_path)
    second.acquire()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    second.release()


def test_a_dead_holder_on_this_host_is_stale(tmp_path):
    pid = dead_pid()
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": pid, "host": socket.gethostname(), "started": 0}))
    lock = RunDirectoryLock(tmp_path)
    notice = lock.acquire()
    assert notice is not None and f"pid {pid}" in notice and "has ended" in notice
    lock.release()


def test_a_live_pid_in_the_file_refuses_even_without_flock(tmp_path):
    """A filesystem that ignores flock: the recorded pid, alive on this host, still decides."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": sleeper.pid, "host": socket.gethostname()}))
        with pytest.raises(RunDirectoryError, match=f"pid {sleeper.pid}"):
            RunDirectoryLock(tmp_path).acquire()
        assert (tmp_path / LOCK_NAME).exists()  # a refusal leaves the holder's file alone
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_holder_on_another_host_refuses_naming_the_file_to_delete(tmp_path):
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": 1, "host": "elsewhere.example"}))
    with pytest.raises(RunDirectoryError, match=f"another host.*delete {tmp_path / LOCK_NAME}"):
        RunDirectoryLock(tmp_path).acquire()


def test_a_refusal_releases_the_locks_already_taken(tmp_path):
    run_dir, checkpoints = tmp_path / "run", tmp_path / "elsewhere"
    holder = RunDirectoryLock(checkpoints)
    checkpoints.mkdir()
    holder.acquire()
    with pytest.raises(RunDirectoryError, match="elsewhere"):
        lock_run_directories([run_dir, checkpoints])
    assert not (run_dir / LOCK_NAME).exists()
    holder.release()
    locks = lock_run_directories([run_dir, run_dir / ".." / "run"])  # one directory, locked once
    assert len(locks) == 1
    locks[0].release()
