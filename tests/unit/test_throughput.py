"""The MFU peak (k3train/training/throughput.py) and the step line's optimizer fields."""

import json

import pytest
import torch

from k3train.training.metrics import format_step_line
from k3train.training.throughput import (
    CPU_PEAK_CACHE_FILE,
    cached_cpu_peak,
    cpu_peak_key,
    measure_cpu_matmul_tflops,
    muon_step_stats,
    peak_flops,
)


class CountingMeasure:
    def __init__(self, value: float):
        self.value, self.calls = value, 0

    def __call__(self) -> float:
        self.calls += 1
        return self.value


def test_cpu_peak_is_measured_once_per_machine_and_thread_count(tmp_path):
    measure = CountingMeasure(0.05)
    first, source = cached_cpu_peak(1, tmp_path, measure)
    assert first == 0.05 and measure.calls == 1 and "measured now" in source
    again, source = cached_cpu_peak(1, tmp_path, CountingMeasure(9.0))  # a busy machine now: ignored
    assert again == 0.05 and "cached in" in source
    other = CountingMeasure(0.09)
    assert cached_cpu_peak(2, tmp_path, other)[0] == 0.09 and other.calls == 1
    entries = json.loads((tmp_path / CPU_PEAK_CACHE_FILE).read_text())
    assert set(entries) == {cpu_peak_key(1), cpu_peak_key(2)}
    assert "torch " + torch.__version__ in cpu_peak_key(1)


def test_unreadable_cache_means_measuring_again(tmp_path):
    (tmp_path / CPU_PEAK_CACHE_FILE).write_text("{not json")
    measure = CountingMeasure(0.07)
    assert cached_cpu_peak(1, tmp_path, measure)[0] == 0.07 and measure.calls == 1
    assert json.loads((tmp_path / CPU_PEAK_CACHE_FILE).read_text())[cpu_peak_key(1)]["tflops"] == 0.07
    unwritable = tmp_path / "file"
    unwritable.write_text("")
    value, source = cached_cpu_peak(1, unwritable / "sub", CountingMeasure(0.03))  # a file in the way
    assert value == 0.03 and "not cached" in source


def test_pinned_peak_and_cached_cpu_peak(tmp_path, monkeypatch):
    pinned = peak_flops(torch.device("cpu"), 12.5)
    assert (pinned.tflops, pinned.label) == (12.5, "MFU") and "logging.peak_tflops" in pinned.describe()
    monkeypatch.setenv("K3TRAIN_CACHE_DIR", str(tmp_path))
    (tmp_path / CPU_PEAK_CACHE_FILE).write_text(
        json.dumps({cpu_peak_key(torch.get_num_threads()): {"tflops": 0.25, "measured": "earlier"}})
    )
    peak = peak_flops(torch.device("cpu"))
    assert (peak.tflops, peak.label) == (0.25, "MFU(cpu-matmul)") and "cached" in peak.source


def test_measurement_is_a_median_of_timed_trials():
    rate = measure_cpu_matmul_tflops(size=64, seconds=0.01, trials=3)
    assert 0 < rate < 100


def test_step_line_reports_the_optimizer_share_apart_from_mfu():
    metrics = {
        "step": 3,
        "loss": 2.0,
        "grad_norm": 1.0,
        "lr": 1e-3,
        "tokens_per_s": 100.0,
        "tflops": 0.01,
        "mfu": 0.1,
        "memory_gib": 0.5,
        "eta": "0:00:01",
        "optimizer_share": 0.3,
        "newton_schulz_gflop": 119.7,
    }
    line = format_step_line(metrics, 10, "MFU(cpu-matmul)")
    assert "MFU(cpu-matmul) 10.0% | opt 30.0% (NS 120 GFLOP)" in line
    metrics.update(newton_schulz_gflop=0.0)
    assert "opt 30.0% |" in format_step_line(metrics, 10, "MFU")


@pytest.mark.parametrize("wrapped", [False, True])
def test_muon_step_stats_through_the_wrapper(wrapped):
    from k3train.optim.muon import PerHeadMuon

    param = torch.nn.Parameter(torch.randn(8, 16))
    param.grad = torch.randn(8, 16)
    muon = PerHeadMuon([param])
    muon.step()
    holder = type("Wrapper", (), {"optimizer": muon})() if wrapped else muon
    assert muon_step_stats(holder).ns_flops > 0
    assert muon_step_stats(torch.optim.AdamW([param])) is None
