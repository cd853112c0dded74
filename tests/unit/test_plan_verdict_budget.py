"""tools/plan.py's memory verdict and the search's --budget: the plain plan says whether its
fullest rank fits the limit the search uses, and a budget stops a search cleanly, saying how
many layouts it left out, without changing the planner's exit statuses (0 a computed plan,
1 no fitting layout listed, 2 a refused layout)."""

import pathlib
import re
import subprocess
import sys

from k3train.planning.hardware import load_profile
from k3train.planning.search import LayoutSearch, search_layouts
from k3train.planning.search_budget import SearchBudget

CHECKOUT = pathlib.Path(__file__).resolve().parents[2]
DEBUG = str(CHECKOUT / "recipes" / "debug.yaml")
VERDICT = re.compile(r"^(fits|does not fit): largest rank ([\d,.]+) GiB \(pp(\d+)\) (<=|>) ([\d,.]+) GiB", re.M)


def plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(CHECKOUT / "tools" / "plan.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=CHECKOUT,
    )


def memory_table_totals(stdout: str) -> dict[int, float]:
    """pp rank -> the `total GiB` column of the per-rank memory table."""
    header = next(line for line in stdout.splitlines() if line.startswith("| pp rank | params |"))
    column = [cell.strip() for cell in header.strip("|").split("|")].index("total GiB")
    rows = [line for line in stdout.splitlines() if re.match(r"\| pp\d+ \|", line)]
    return {
        int(row.split("|")[1].strip()[2:]): float(row.strip("|").split("|")[column].replace(",", "")) for row in rows
    }


def test_small_plan_fits_and_names_its_fullest_rank():
    result = plan("--recipe", DEBUG, "--world-size", "2", "--hardware", "h100", "parallel.pp=2")
    assert result.returncode == 0, result.stderr
    verdicts = VERDICT.findall(result.stdout)
    assert len(verdicts) == 1, result.stdout
    word, largest, pp_rank, sign, limit = verdicts[0]
    assert (word, sign) == ("fits", "<=")
    totals = memory_table_totals(result.stdout)
    # The table rounds to 0.1 GiB; the verdict may print more digits of the same number.
    assert abs(float(largest.replace(",", "")) - max(totals.values())) <= 0.05 + 1e-9
    assert totals[int(pp_rank)] == max(totals.values())
    assert abs(float(limit.replace(",", "")) - load_profile("h100").memory_limit_gib()) <= 0.05  # the search's limit


def test_plan_over_a_tiny_limit_does_not_fit_and_still_exits_0():
    result = plan(
        "--recipe", DEBUG, "--world-size", "2", "--hardware", "h100", "--memory-limit", "0.0001", "parallel.pp=2"
    )
    assert result.returncode == 0, result.stderr  # a computed plan, whether or not it fits
    word, _, _, sign, _ = VERDICT.findall(result.stdout)[0]
    assert (word, sign) == ("does not fit", ">")
    line = next(line for line in result.stdout.splitlines() if line.startswith("does not fit:"))
    assert "--memory-limit" in line and "--search" in line


def test_zero_budget_evaluates_nothing_and_says_so():
    search = LayoutSearch(DEBUG, load_profile("h100"), budget=SearchBudget(seconds=0))
    outcome = search.run(8)
    assert outcome.out_of_budget and outcome.candidates == ()
    assert outcome.layouts > 0 and outcome.unevaluated == outcome.layouts


def test_unlimited_search_evaluates_everything_with_the_same_ranking():
    hardware = load_profile("h100")
    outcome = LayoutSearch(DEBUG, hardware).run(8, top=4)
    assert not outcome.out_of_budget and outcome.unevaluated == 0
    assert list(outcome.candidates) == search_layouts(DEBUG, 8, hardware, top=4)


def test_search_budget_message_on_the_command_line():
    result = plan("--recipe", DEBUG, "--world-size", "8", "--hardware", "h100", "--search", "--budget", "0")
    assert result.returncode == 1, result.stdout + result.stderr  # nothing evaluated: no layout listed
    assert "search stopped by --budget 0 s" in result.stdout
    assert re.search(r"layouts of world 8", result.stdout)


def test_refused_world_size_under_a_budget_keeps_exit_status_2():
    result = plan("--recipe", DEBUG, "--world-size", "6", "--hardware", "h100", "--budget", "0", "parallel.tp=4")
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith("error:") and "search stopped by --budget 0 s" in result.stdout
