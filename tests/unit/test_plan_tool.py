"""tools/plan.py: exact per-rank parameter counts from meta-device stages, clear layout errors, the
verdict on memory, the search's budget and progress."""

import pathlib
import re
import subprocess
import sys

import pytest

from k3train.planning.memory import MEMORY_HEADER

CHECKOUT = pathlib.Path(__file__).resolve().parents[2]


def plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(CHECKOUT / "tools" / "plan.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=CHECKOUT,
    )


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
    """K3 at 1,024 H200s prints memory with activations per pipeline rank,
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
    # The recipe's own layout fits an H200 by the planner's model, its fullest rank under the limit.
    largest = largest_rank_gib(out)
    assert largest <= 118.2
    assert verdict_line(out).startswith(f"fits: largest rank {largest:.1f} GiB (pp")
    assert "<= 118.2 GiB (limit: 90% of the 141 GB HBM of one H200 SXM)" in verdict_line(out)


@pytest.mark.parametrize("world_size", [2048, 4096])
def test_k3_recipe_fits_an_h200_at_larger_world_sizes(world_size):
    """The same recipe at 2,048 and 4,096 GPUs (dp grows, nothing else changes) fits too."""
    result = plan("--recipe", "recipes/k3.yaml", "--world-size", str(world_size), "--hardware", "h200")
    assert result.returncode == 0, result.stderr
    assert largest_rank_gib(result.stdout) <= 118.2
    assert verdict_line(result.stdout).startswith("fits: largest rank ")


def test_k3_recipe_s_old_layout_with_fp32_weights_does_not_fit():
    """Without cp and the master shards (the recipe's previous layout) the fullest rank is pp1, over the limit."""
    result = plan(
        "--recipe",
        "recipes/k3.yaml",
        "--world-size",
        "1024",
        "--hardware",
        "h200",
        "parallel.cp=1",
        "train.weights=fp32",
        "train.grad_dtype=fp32",
        "parallel.pipeline_layers=[5,6,6,6,6,6,6,6,6,6,6,6,6,6,6,4]",
    )
    out = result.stdout
    assert verdict_line(out).startswith(
        f"does not fit: largest rank {largest_rank_gib(out):.1f} GiB (pp1) > 118.2 GiB "
        "(limit: 90% of the 141 GB HBM of one H200 SXM); "
    )
    assert "--world-size 1024 --hardware h200 --search" in verdict_line(out)


def verdict_line(stdout: str) -> str:
    lines = [line for line in stdout.splitlines() if line.startswith(("fits:", "does not fit:"))]
    assert len(lines) == 1, stdout
    return lines[0]


def largest_rank_gib(stdout: str) -> float:
    return max(
        float(row.strip("|").split("|")[MEMORY_HEADER.index("total GiB")].replace(",", ""))
        for row in stdout.splitlines()
        if re.match(r"\| pp\d+ \|", row)
    )


def test_a_plan_that_fits_says_so():
    """The debug model on one H100: the verdict names the fullest rank and the search's default
    limit (90% of 80 GB), and the plan exits 0."""
    result = plan("--recipe", "recipes/debug.yaml", "--world-size", "2", "--hardware", "h100", "parallel.pp=2")
    assert result.returncode == 0, result.stderr
    line = verdict_line(result.stdout)
    found = re.fullmatch(
        r"fits: largest rank ([\d.]+) GiB \(pp(\d)\) <= ([\d.]+) GiB \(limit: 90% of the 80 GB HBM "
        r"of one H100 SXM\)",
        line,
    )
    assert found, line
    assert float(found.group(1)) == pytest.approx(largest_rank_gib(result.stdout), abs=0.051)
    assert float(found.group(3)) == pytest.approx(80e9 * 0.9 / 2**30, abs=0.05)


def test_a_plan_that_does_not_fit_says_so_and_how_to_find_one_that_does():
    """Below the fullest rank's total, `--memory-limit` turns the verdict (the plan was computed:
    exit 0) and the line names the search command with the same limit."""
    result = plan("--recipe", "recipes/debug.yaml", "--world-size", "2", "--memory-limit", "0.01", "parallel.pp=2")
    assert result.returncode == 0, result.stderr
    line = verdict_line(result.stdout)
    found = re.match(r"does not fit: largest rank ([\d.]+) GiB \(pp\d\) > 0.01 GiB \(limit: --memory-limit\); ", line)
    assert found, line
    assert float(found.group(1)) == pytest.approx(largest_rank_gib(result.stdout), abs=0.051)
    assert (
        "python tools/plan.py --recipe recipes/debug.yaml --world-size 2 --hardware h200 --search "
        "--memory-limit 0.01 parallel.pp=2"
    ) in line


def test_search_budget_stops_with_a_message():
    """`--budget 0` stops before the first layout: the search says how many it left out and, having
    found nothing, exits 1 without claiming that nothing fits."""
    result = plan(
        "--recipe", "recipes/debug.yaml", "--world-size", "8", "--hardware", "h100", "--search", "--budget", "0"
    )
    assert result.returncode == 1, result.stderr
    assert re.search(
        r"search stopped by --budget 0 s before any of the [\d,]+ layouts of world 8 was evaluated", result.stdout
    ), result.stdout
    assert "nearest world sizes not searched" in result.stdout


def test_search_draws_progress_on_a_terminal(monkeypatch):
    """On a terminal's stderr the search draws a tqdm bar over the layouts; stdout keeps the table."""
    import contextlib
    import importlib.util
    import io

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    spec = importlib.util.spec_from_file_location("plan_cli_progress", CHECKOUT / "tools" / "plan.py")
    plan_cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plan_cli)
    stdout, stderr = io.StringIO(), Terminal()
    monkeypatch.setattr(sys, "stderr", stderr)
    with contextlib.redirect_stdout(stdout):
        code = plan_cli.main(
            [
                "--recipe",
                str(CHECKOUT / "recipes" / "debug.yaml"),
                "--world-size",
                "4",
                "--hardware",
                "h100",
                "--search",
            ]
        )
    assert code == 0
    assert "| tp |" in stdout.getvalue() and "world 4:" not in stdout.getvalue()
    assert re.search(r"world 4: 100%.*layout", stderr.getvalue()), stderr.getvalue()[-500:]
