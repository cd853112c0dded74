"""`train.host_heap`: glibc keeps the memory torch frees (k3train/training/host_heap.py)."""

import subprocess
import sys
import textwrap

import pytest

from k3train.training.host_heap import (
    DYNAMIC_MAXIMUM_BYTES,
    KEPT_BYTES,
    M_MMAP_THRESHOLD,
    M_TRIM_THRESHOLD,
    _glibc,
    configure_host_heap,
    keep_freed_memory,
)


class FakeGlibc:
    """Records `mallopt` calls; refuses the values in `refused`."""

    def __init__(self, refused=()):
        self.calls = []
        self.refused = set(refused)

    def mallopt(self, parameter, value):
        self.calls.append((parameter, value))
        return 0 if (parameter, value) in self.refused else 1

    def gnu_get_libc_version(self):
        return b"2.99"


def test_the_mmap_threshold_is_fixed_before_the_trim_threshold():
    # A fixed trim threshold alone would leave the mmap threshold at 128 KiB (every tensor mmapped).
    libc = FakeGlibc()
    line = keep_freed_memory(libc)
    assert libc.calls == [(M_MMAP_THRESHOLD, KEPT_BYTES), (M_TRIM_THRESHOLD, KEPT_BYTES)]
    assert line is not None and "glibc 2.99" in line and "1024 MiB" in line and "train.host_heap=system" in line


def test_a_refused_threshold_falls_back_to_glibcs_dynamic_maximum():
    libc = FakeGlibc(refused={(M_MMAP_THRESHOLD, KEPT_BYTES)})
    line = keep_freed_memory(libc)
    assert libc.calls[1:] == [(M_MMAP_THRESHOLD, DYNAMIC_MAXIMUM_BYTES), (M_TRIM_THRESHOLD, KEPT_BYTES)]
    assert line is not None and "mmap threshold 32 MiB" in line


def test_no_trim_threshold_without_an_mmap_threshold():
    libc = FakeGlibc(refused={(M_MMAP_THRESHOLD, KEPT_BYTES), (M_MMAP_THRESHOLD, DYNAMIC_MAXIMUM_BYTES)})
    assert keep_freed_memory(libc) is None
    assert all(parameter == M_MMAP_THRESHOLD for parameter, _ in libc.calls)


def test_system_and_gpu_runs_change_nothing(monkeypatch):
    called = []
    monkeypatch.setattr("k3train.training.host_heap.keep_freed_memory", lambda: called.append(1))
    assert configure_host_heap("system", "cpu") is None
    assert configure_host_heap("keep_freed", "cuda") is None
    assert called == []


FAULTS_OF_A_LOOP = textwrap.dedent(
    """
    import resource, sys, torch
    from k3train.training.host_heap import configure_host_heap
    configure_host_heap(sys.argv[1], "cpu")
    sizes = [40, 8, 48, 3, 36]  # MiB: above glibc's 32 MiB dynamic ceiling and below it
    def step():  # a few tensors alive at once, written, one more made from two, all freed
        tensors = [torch.empty(size << 18).fill_(1.0) for size in sizes]
        tensors[0] = tensors[0] + tensors[2][: tensors[0].numel()]
    for _ in range(3):
        step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        step()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """
)

ROUND_PAGES = (40 + 8 + 48 + 3 + 36) * 256  # 4 KiB pages the tensors of one round span


@pytest.mark.skipif(sys.platform != "linux" or _glibc() is None, reason="glibc's malloc only")
def test_kept_memory_is_not_faulted_in_again():
    # The same rounds as a step repeats them: glibc's defaults fault the tensors' pages in every
    # round (5 x 34,560 pages: about 215,000 faults here), kept memory 0-7,200 (the heap settling).
    faults = {
        setting: int(
            subprocess.run(
                [sys.executable, "-c", FAULTS_OF_A_LOOP, setting],
                capture_output=True,
                text=True,
                timeout=120,
                check=True,
            ).stdout
        )
        for setting in ("system", "keep_freed")
    }
    assert faults["system"] >= 5 * ROUND_PAGES // 2, faults  # (huge pages would fault fewer: half is enough)
    assert faults["keep_freed"] < 5 * ROUND_PAGES // 10, faults
