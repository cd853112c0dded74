"""Checkpoint faults: a full disk during a save (ENOSPC injected below DCP), a failed asynchronous
save, a process killed (-9) while an asynchronous save is being written. Each asserts the one-line
reaction, that the previous checkpoint stays the newest complete one, and that it still loads bit-exactly."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint.filesystem as dcp_filesystem
from torch import nn

from k3train.checkpoint import Checkpointer, CheckpointError, verify_checkpoint

CHECKOUT = Path(__file__).resolve().parents[2]


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 4))


def _disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def _assert_previous_intact(root: Path, first: Path, expected: nn.Module) -> None:
    assert Checkpointer(root).latest() == first
    verify_checkpoint(first)
    assert not [p for p in root.iterdir() if p.name.startswith(".")]  # no temp remains
    loaded = _model(99)
    Checkpointer(root).load(first, {"model": loaded})
    for a, b in zip(expected.state_dict().values(), loaded.state_dict().values()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("async_save", [False, True])
def test_disk_full_during_save_is_one_line_and_keeps_the_previous(tmp_path, monkeypatch, async_save):
    model = _model(0)
    ck = Checkpointer(tmp_path, async_save=async_save)
    first = ck.save(1, {"model": model})
    ck.wait()
    saved = _model(0)
    monkeypatch.setattr(dcp_filesystem, "_write_item", _disk_full)
    with pytest.raises(CheckpointError) as info:
        ck.save(2, {"model": model})
        ck.wait()  # an asynchronous save reports its failure here
    message = str(info.value)
    assert "\n" not in message
    assert f"no space left on device in {tmp_path}" in message and "bytes free" in message
    assert f"the newest complete checkpoint {first} is kept" in message
    monkeypatch.undo()
    _assert_previous_intact(tmp_path, first, saved)


def test_failed_async_save_surfaces_at_the_next_save(tmp_path, monkeypatch):
    model = _model(0)
    ck = Checkpointer(tmp_path, async_save=True)
    first = ck.save(1, {"model": model})
    assert ck.wait() == first
    import threading

    failed = threading.Event()

    def disk_full_once(*args, **kwargs):
        failed.set()
        _disk_full()

    monkeypatch.setattr(dcp_filesystem, "_write_item", disk_full_once)
    ck.save(2, {"model": model})  # returns at once: the write fails in the background
    assert failed.wait(timeout=30)
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match="step_00000002 failed.*no space left"):
        ck.save(3, {"model": model})
    assert ck.wait() is None
    assert ck.latest() == first


_SLOW_ASYNC_SAVE = textwrap.dedent("""
    import sys, time
    import torch
    import torch.distributed.checkpoint.filesystem as fs
    from torch import nn
    from k3train.checkpoint import Checkpointer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 4))
    ck = Checkpointer({root!r}, async_save=True)
    ck.save(1, {{"model": model}})
    ck.wait()
    original = fs._write_item

    def slow(*args, **kwargs):  # the background write is still going when the process is killed
        time.sleep(0.5)
        return original(*args, **kwargs)

    fs._write_item = slow
    ck.save(2, {{"model": model}})
    print("writing", flush=True)
    for step in range(1000):  # training continues meanwhile
        time.sleep(0.1)
""")


def test_kill_9_during_an_async_save_leaves_the_previous_checkpoint(tmp_path):
    root = tmp_path / "ckpt"
    script = _SLOW_ASYNC_SAVE.format(checkout=str(CHECKOUT), root=str(root))
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    try:
        assert proc.stdout.readline().strip() == "writing"
        deadline = time.monotonic() + 30
        while not list(root.glob(".tmp_step_00000002_*/*.distcp")) and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert list(root.glob(".tmp_step_00000002_*"))  # killed mid-write
    assert not (root / "step_00000002").exists()
    _assert_previous_intact(root, root / "step_00000001", _model(0))  # start-up removes the remains
