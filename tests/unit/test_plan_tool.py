"""tools/plan.py: exact per-rank parameter counts from meta-device stages, clear layout errors."""

import pathlib
import re
import subprocess
import sys

CHECKOUT = pathlib.Path(__file__).resolve().parents[2]


def plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHECKOUT / "tools" / "plan.py"), *args], capture_output=True,
                          text=True, timeout=300, cwd=CHECKOUT)


def test_pipeline_ranks_add_up_to_the_model():
    result = plan("--recipe", "recipes/debug.yaml", "--world-size", "2", "parallel.pp=2")
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("| 0 ") or line.startswith("| 1 ")]
    per_rank = [int(row.split("|")[3].replace(",", "")) for row in rows]
    from k3train.model.config import ModelConfig
    from k3train.model.flops import parameter_counts

    assert len(per_rank) == 2 and sum(per_rank) == parameter_counts(ModelConfig()).total
    assert "naive" in result.stdout and "exact" in result.stdout


def test_impossible_layout_is_one_line():
    result = plan("--recipe", "recipes/debug.yaml", "--world-size", "6", "parallel.tp=4")
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "tp*pp" in result.stderr


def test_k3_plan_prints_memory_traffic_bubble_and_step_time():
    """The issue's done-when: K3 at 1,024 H200s prints memory with activations per pipeline rank,
    the bytes of every group including PP and EP, the ZeRO-1 wire bytes, the bubble and the step
    time with MFU."""
    result = plan("--recipe", "recipes/k3.yaml", "--world-size", "1024", "--hardware", "h200")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "| activations | AttnRes cache | EP buffers |" in out
    assert sum(re.match(r"\| pp\d+ \|", line) is not None for line in out.splitlines()) == 16  # every stage
    counted = next(line for line in out.splitlines() if line.startswith("bytes per rank and step"))
    assert all(f"{group} " in counted for group in ("tp", "dp", "pp", "ep"))
    assert "ZeRO-1 exchange on the wire" in out and "gradients all-reduced instead" in out
    assert "| pipeline bubble |" in out and "MFU" in out and "step " in out
