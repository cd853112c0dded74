"""tools/plan.py: exact per-rank parameter counts from meta-device stages, clear layout errors."""

import pathlib
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
