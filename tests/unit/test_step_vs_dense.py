"""benchmarks/step_vs_dense.py's pieces that a wrong number would hide in: the dense peer sized to
k3train's FLOPs per token, and one comparison end to end on the CPU in bf16 autocast with the
profiled parts and the operation counts (the path `--device cuda --precision bf16` takes, minus
the device)."""

import math

import pytest
import torch

from k3train.benchmarking.step_comparison import (
    ADAMW,
    DEBUG_RECIPE,
    DENSE,
    MODELS,
    MUON,
    PARTS,
    compare,
    dense_flops_per_token,
    page_faults,
    size_dense_peer,
)
from k3train.config import load_config
from k3train.model.flops import training_flops_per_token


@pytest.mark.parametrize("model", sorted(MODELS))
def test_dense_peer_has_k3trains_flops_per_token(model):
    config = load_config(str(DEBUG_RECIPE), MODELS[model])
    seq, layers, vocab = config.data.seq_length, config.model.num_hidden_layers, config.model.vocab_size
    target = training_flops_per_token(config.model, seq).total
    width, mlp = size_dense_peer(target, layers, vocab, seq)
    assert width % 64 == 0 and mlp % 8 == 0
    # The SwiGLU size is solved to a multiple of 8: one step of it moves the count by
    # 3 · layers · 2 · 3 · width FLOPs per token, the bound on the remaining difference.
    step = 3 * layers * 2 * 3 * width
    assert abs(dense_flops_per_token(layers, width, mlp, vocab, seq) - target) <= step * 4 + 1e-6 * target


def test_dense_flops_per_token_counts_matmuls():
    # One layer of width 64, SwiGLU 128, vocabulary 100, T = 3: q, k, v, o (4·64²), SwiGLU
    # (3·64·128), causal attention over (3 + 1) / 2 keys for QKᵀ and AV (2·64·2), head (64·100);
    # × 2 FLOPs per multiply-add, × 3 for training.
    expected = 3 * 2 * (4 * 64 * 64 + 3 * 64 * 128 + 2 * 64 * 2 + 64 * 100)
    assert dense_flops_per_token(1, 64, 128, 100, 3) == expected


@pytest.mark.slow
def test_compare_in_bf16_with_profiled_parts(capsys):
    torch.set_num_threads(1)
    result = compare(
        "debug",
        MODELS["debug"],
        steps=1,
        peak_tflops=0.1,
        with_compile=False,
        profile=True,
        device=torch.device("cpu"),
        precision="bf16",
        warmup=2,
    )
    out = capsys.readouterr().out
    assert set(result.step_seconds) == {MUON, ADAMW, DENSE}
    assert all(math.isfinite(loss) and loss > 0 for loss in result.final_losses.values())
    assert result.tokens == 1024
    assert result.adamw_vs_dense == pytest.approx(result.step_seconds[DENSE] / result.step_seconds[ADAMW])
    assert "after 2 warm-up round(s) on cpu, bf16" in out
    # Each timed step's page faults were read (a count, one per contender).
    assert set(result.page_faults) == set(result.step_seconds)
    assert all(faults >= 0 for faults in result.page_faults.values())
    # Every contender's step was counted; k3train's machinery runs many more operations.
    assert set(result.operations) == set(result.step_seconds)
    assert all(compute > 0 and views > 0 for compute, views in result.operations.values())
    assert result.operations[ADAMW][0] > 2 * result.operations[DENSE][0]
    for part in PARTS:  # the profiled step's table has every part
        assert f"| {part} " in out


def test_compare_refuses_no_warm_up():
    with pytest.raises(ValueError, match="warmup must be at least 1"):
        compare("debug", MODELS["debug"], 1, 0.1, False, False, warmup=0)


def test_page_faults_count_fresh_memory():
    before = page_faults()
    fresh = torch.empty(64 << 20, dtype=torch.uint8)  # 64 MiB: mmapped, untouched
    fresh.fill_(1)  # first touch: 16,384 pages of 4 KiB, or 32 of 2 MiB under transparent huge pages
    assert page_faults() - before >= 32
