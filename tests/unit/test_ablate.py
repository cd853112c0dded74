"""k3train/ablation: grid expansion, seed statistics, FLOP matching, ladder fits, curves, report
formatting, and tools/ablate.py's command line."""

import importlib.util
import json
import math
import pathlib

import pytest

from k3train.ablation import stats
from k3train.ablation.curves import band, band_caption, ema, read_curves
from k3train.ablation.grid import Sweep, Variant, expand, load_sweep_file, parse_grid_option
from k3train.ablation.ladder import PowerLaw, compute_multiplier, fit_power_law
from k3train.ablation.matching import MatchedSteps, apply_match, match_overrides, matched_steps, run_cost
from k3train.ablation.plots import figure_title, legend_label
from k3train.ablation.report import (
    format_count,
    format_interval,
    format_rate,
    format_test,
    reading,
    reading_rule,
    summary_table,
)
from k3train.ablation.results import ArmSummary
from k3train.config.recipe import ConfigError

CHECKOUT = pathlib.Path(__file__).resolve().parents[2]
TINY = str(CHECKOUT / "recipes" / "ladder" / "cpu-tiny.yaml")
spec = importlib.util.spec_from_file_location("ablate_cli", CHECKOUT / "tools" / "ablate.py")
assert spec is not None and spec.loader is not None
ablate = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ablate)


# ------------------------------------------------------------------ grid
def test_variants_cross_grid_cross_seeds_in_a_fixed_order():
    sweep = Sweep(
        recipes=[TINY],
        variants=[Variant("a", ("model.attn_res=none",)), Variant("b")],
        grid={"optimizer.lr": ["1e-3", "3e-3"]},
        seeds=2,
        overrides=("train.steps=5",),
    )
    runs = expand(sweep)
    assert len(runs) == 2 * 2 * 2
    assert [r.relative_dir for r in runs[:4]] == [
        "a,lr=1e-3/seed0",
        "a,lr=1e-3/seed1",
        "a,lr=3e-3/seed0",
        "a,lr=3e-3/seed1",
    ]
    first = runs[1]
    # shared, then the seed fields, then the arm's own (variant, then grid) overrides
    assert first.overrides == (
        "train.steps=5",
        "train.seed=1235",
        "data.seed=1235",
        "model.attn_res=none",
        "optimizer.lr=1e-3",
    )
    # each arm against the first variant at the same grid point
    assert sweep.baseline_arms() == {
        "a,lr=1e-3": "a,lr=1e-3",
        "a,lr=3e-3": "a,lr=3e-3",
        "b,lr=1e-3": "a,lr=1e-3",
        "b,lr=3e-3": "a,lr=3e-3",
    }
    sweep.baseline = "b,lr=3e-3"  # an arm's full name: everything against it
    assert set(sweep.baseline_arms().values()) == {"b,lr=3e-3"}
    assert expand(sweep) == runs  # deterministic: the same sweep resumes into the same directories


def test_grid_alone_names_runs_by_its_values_and_a_ladder_prefixes_the_size(tmp_path):
    small = tmp_path / "small.yaml"
    small.write_text("train:\n  steps: 3\n")
    runs = expand(Sweep(recipes=[TINY, str(small)], grid={"model.attn_res": ["none", "full"]}, ladder=True))
    assert [r.relative_dir for r in runs] == [
        "cpu-tiny/attn_res=none/seed0",
        "cpu-tiny/attn_res=full/seed0",
        "small/attn_res=none/seed0",
        "small/attn_res=full/seed0",
    ]
    assert {r.size for r in runs} == {"cpu-tiny", "small"}
    assert set(Sweep(recipes=[TINY], grid={"model.attn_res": ["none", "full"]}).baseline_arms().values()) == {
        "attn_res=none"
    }


def test_sweep_file_and_its_errors(tmp_path):
    sweep = load_sweep_file(str(CHECKOUT / "recipes" / "ablations" / "attn_res.yaml"))
    assert sweep.recipes == [str(pathlib.Path("recipes/ladder/cpu-tiny.yaml"))] or sweep.recipes[0].endswith(
        "ladder/cpu-tiny.yaml"
    )
    assert (
        [v.name for v in sweep.variants] == ["none", "block", "full"] and sweep.baseline == "none" and sweep.seeds == 3
    )
    layouts = tmp_path / "layouts.yaml"
    layouts.write_text(f"base: {TINY}\nvariants:\n  one: []\n  tp2: {{overrides: [parallel.tp=2], nproc: 2}}\n")
    assert [r.nproc for r in expand(load_sweep_file(str(layouts)))] == [None, 2]
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"base: {TINY}\nvariant: {{a: []}}\n")
    with pytest.raises(ConfigError, match="unknown key.*variant"):
        load_sweep_file(str(bad))
    bad.write_text(f"base: {TINY}\nvariants: {{a: []}}\nbaseline: b\n")
    with pytest.raises(ConfigError, match="baseline 'b'"):
        expand(load_sweep_file(str(bad)))
    bad.write_text("base: nowhere.yaml\n")
    with pytest.raises(ConfigError, match="nowhere.yaml does not exist"):
        expand(load_sweep_file(str(bad)))
    with pytest.raises(ConfigError, match="section.field=v1,v2"):
        parse_grid_option("lr=1,2")
    assert parse_grid_option("optimizer.lr=1e-3, 3e-3") == ("optimizer.lr", ["1e-3", "3e-3"])


def test_command_line_adds_to_the_sweep_file():
    args, shared = ablate.parse_args(
        [
            "--sweep",
            str(CHECKOUT / "recipes/ablations/attn_res.yaml"),
            "--out",
            "o",
            "--variant",
            "block-2",
            "model.attn_res_block_size=2",
            "--seeds",
            "2",
            "--grid",
            "optimizer.lr=1e-3,2e-3",
            "--",
            "train.steps=5",
        ]
    )
    sweep = ablate.build_sweep(args, shared)
    assert [v.name for v in sweep.variants] == ["none", "block", "full", "block-2"]
    assert (
        sweep.seeds == 2 and sweep.grid == {"optimizer.lr": ["1e-3", "2e-3"]} and sweep.overrides == ("train.steps=5",)
    )
    assert len(expand(sweep)) == 4 * 2 * 2
    with pytest.raises(SystemExit):
        ablate.parse_args(["--out", "o"])  # nothing to run


# ------------------------------------------------------------------ statistics
def test_mean_std_and_t_quantiles_against_published_values():
    assert stats.mean([1, 2, 3, 4]) == 2.5
    assert math.isclose(stats.sample_std([1, 2, 3, 4]), math.sqrt(5 / 3))
    assert stats.sample_std([7.0]) == 0.0
    # two-sided 95 % critical values (any statistics table) and a one-sided 95 % one
    for dof, value in [(1, 12.7062047), (2, 4.3026527), (3, 3.1824463), (10, 2.2281389), (30, 2.0422725)]:
        assert math.isclose(stats.student_t_quantile(0.975, dof), value, rel_tol=1e-6)
    assert math.isclose(stats.student_t_quantile(0.95, 5), 2.0150484, rel_tol=1e-6)
    assert math.isclose(stats.student_t_quantile(0.025, 4), -2.7764451, rel_tol=1e-6)
    assert math.isclose(stats.student_t_cdf(0.0, 3.5), 0.5)


def test_confidence_intervals_paired_and_welch():
    interval = stats.mean_interval([1.0, 2.0, 3.0, 4.0])
    half = 3.1824463 * math.sqrt(5 / 3) / 2
    assert math.isclose(interval.low, 2.5 - half, rel_tol=1e-6) and math.isclose(
        interval.high, 2.5 + half, rel_tol=1e-6
    )
    # paired: the seeds' shared offset cancels; differences 0.1, 0.2, 0.3 → mean 0.2, std 0.1
    paired = stats.difference_interval({0: 5.1, 1: 6.2, 2: 7.3}, {0: 5.0, 1: 6.0, 2: 7.0})
    assert paired.method.startswith("paired") and math.isclose(paired.estimate, 0.2)
    assert math.isclose(paired.high - paired.estimate, 4.3026527 * 0.1 / math.sqrt(3), rel_tol=1e-6)
    # Welch (different seeds): a = [1, 2, 3], b = [2, 4, 6, 8]; var/n 1/3 and 20/12 → dof 3.47
    welch = stats.difference_interval({0: 1.0, 1: 2.0, 2: 3.0}, {5: 2.0, 6: 4.0, 7: 6.0, 8: 8.0})
    va, vb = 1 / 3, (20 / 3) / 4
    dof = (va + vb) ** 2 / (va**2 / 2 + vb**2 / 3)
    assert welch.method.startswith("Welch") and math.isclose(welch.estimate, -3.0)
    assert math.isclose(welch.high - welch.estimate, stats.student_t_quantile(0.975, dof) * math.sqrt(va + vb))
    assert stats.difference_interval({0: 1.0}, {0: 2.0}).low is None  # one seed: no interval


def test_no_claim_below_three_seeds_and_the_reading_follows_the_printed_interval():
    # the reported case: 2 seeds whose paired differences coincide (zero spread, a zero-width
    # interval that "excluded" 0); no interval and no claim now
    two = stats.difference_interval({0: 2.05, 1: 2.10}, {0: 2.04, 1: 2.09})
    assert two.low is None and two.method == "too few seeds to tell (n=2; need ≥ 3)"
    assert reading(two) == two.method and "(no interval)" in format_interval(two)
    welch_two = stats.difference_interval({0: 2.0, 1: 2.1}, {5: 1.9, 6: 2.2})
    assert welch_two.low is None and "n=2" in welch_two.method
    # 3 seeds whose paired differences coincide: each arm's own spread (Welch's), never zero width
    three = stats.difference_interval({0: 2.01, 1: 2.11, 2: 2.21}, {0: 2.0, 1: 2.1, 2: 2.2})
    assert three.method.startswith("Welch") and three.low < 0 < three.high and reading(three).startswith("not")
    paired = stats.difference_interval({0: 2.02, 1: 2.121, 2: 2.219}, {0: 2.0, 1: 2.1, 2: 2.2})
    assert paired.method == "paired t" and paired.dof == 2 and format_test(paired) == "paired t, ν = 2"
    assert reading(paired) == "higher: interval excludes 0" and paired.low > 0
    # decided on the bounds as printed: a low bound that prints as +0.0000 does not exclude 0
    assert (
        reading(stats.Interval(0.01, 0.00002, 0.02, "paired t", dof=2, seeds=3))
        == "not distinguishable from seed noise"
    )
    assert reading(stats.Interval(-0.02, -0.03, -0.01, "paired t", dof=2, seeds=3)) == "lower: interval excludes 0"
    rule = " ".join(reading_rule(0.95))
    assert "two-sided t-test" in rule and "fewer than 3 seeds" in rule and "Welch" in rule


def test_one_seed_has_no_band_in_plots_or_captions():
    single = band([([1, 2], [3.0, 2.0])])
    assert single.seeds == 1 and legend_label("a", single) == "a (1 seed: no band)"
    assert band_caption([1, 1]) == "1 seed: no band"
    assert band_caption([3, 3]) == "band: min–max over 3 seeds"
    assert band_caption([1, 3]) == "band: min–max over seeds (arms with 1 seed: no band)"
    three = band([([1, 2], [3.0, 2.0]), ([1, 2], [3.5, 2.5]), ([1, 2], [2.5, 1.5])])
    assert figure_title("loss", [("train", {"a": single, "b": single})]) == "loss (1 seed: no band)"
    assert figure_title("loss", [("train", {"a": three})]) == "loss (band: min–max over 3 seeds)"


# ------------------------------------------------------------------ FLOP matching
def test_matched_steps_are_within_one_step_and_keep_the_final_step_evaluated():
    assert matched_steps(1000.0, 10.0, 0) == MatchedSteps(100, 0)
    assert matched_steps(1000.0, 10.0, 25.0) == MatchedSteps(100, 25)  # the baseline itself: unchanged
    matched = matched_steps(1000.0, 3.3, 50.5)  # exact 303.03 steps, evaluated about every 50.5
    assert abs(matched.steps - 1000.0 / 3.3) < 1 and matched.steps % matched.eval_interval == 0
    # a short run: 20 baseline steps evaluated every 5, a variant costing 1.1× per step. Whole
    # intervals of 5 rounded 18.2 steps back to 20 (no match at all).
    matched = matched_steps(20.0, 1.1, 5.0 / 1.1)
    assert matched.steps == 18 and matched.steps % matched.eval_interval == 0
    # 101 steps is prime (every step or only the last): 100 = 10 · 10 keeps the spacing near 10
    assert matched_steps(100.6, 1.0, 10.0) == MatchedSteps(100, 10)


def test_flop_matching_gives_every_arm_the_baselines_flops():
    sweep = Sweep(
        recipes=[TINY],
        variants=[
            Variant("none", ("model.attn_res=none",)),
            Variant("full", ("model.attn_res=full",)),
            Variant("short", ("data.seq_length=32",)),
        ],
        seeds=2,
    )
    matched = apply_match(expand(sweep), "flops", sweep.baseline_arms())
    base = run_cost(TINY, ("model.attn_res=none",))
    for spec in matched:
        cost = run_cost(spec.recipe, spec.overrides)
        per_step = cost.tokens_per_step * cost.flops_per_token
        assert abs(cost.flops - base.flops) < per_step, spec.arm  # within one of its own steps
        assert cost.steps % cost.eval_interval == 0, spec.arm  # the final step is evaluated
    full = run_cost(TINY, next(s for s in matched if s.arm == "full").overrides)
    assert full.flops_per_token > base.flops_per_token and full.steps < base.steps  # full AttnRes costs more per token
    # tokens: the half-length sequences get twice the steps
    tokens = match_overrides("tokens", base, run_cost(TINY, ("data.seq_length=32",)))
    assert tokens[0] == f"train.steps={2 * base.steps}"


def test_flop_matching_changes_a_short_run():
    """100 steps evaluated every 10: full AttnRes's 1.8 % more FLOPs per token cost it 2 steps
    (whole intervals of 10 left it at 100), and its final step is still evaluated."""
    sweep = Sweep(
        recipes=[TINY],
        variants=[Variant("none", ("model.attn_res=none",)), Variant("full", ("model.attn_res=full",))],
        overrides=("train.steps=100", "train.eval_interval=10"),
    )
    base, full = (run_cost(s.recipe, s.overrides) for s in apply_match(expand(sweep), "flops", sweep.baseline_arms()))
    assert (base.steps, base.eval_interval) == (100, 10)
    exact = base.flops / (full.tokens_per_step * full.flops_per_token)
    assert 97.5 < exact < 98.5 and full.steps == 98 and full.steps % full.eval_interval == 0
    assert 5 <= full.steps // full.eval_interval <= 20  # about the baseline's 10 evaluations


# ------------------------------------------------------------------ ladder
def test_power_law_fit_recovers_synthetic_laws_and_the_compute_multiplier():
    compute = [1e15, 1e16, 1e17, 1e18]
    baseline = [50.0 * c**-0.1 for c in compute]
    better = [50.0 * (1.25 * c) ** -0.1 for c in compute]  # the same loss with 1/1.25 of the compute
    fit_base, fit_better = fit_power_law(compute, baseline), fit_power_law(compute, better)
    assert math.isclose(fit_base.b, 0.1, rel_tol=1e-9) and math.isclose(fit_base.a, 50.0, rel_tol=1e-9)
    assert math.isclose(compute_multiplier(fit_better, fit_base, 1.5), 1.25, rel_tol=1e-9)
    with_floor = [1.7 + 40.0 * c**-0.15 for c in compute] + [1.7 + 40.0 * 1e19**-0.15]
    law = fit_power_law(compute + [1e19], with_floor, irreducible=True, grid_points=1700)
    assert abs(law.irreducible - 1.7) < 0.01 and abs(law.b - 0.15) < 0.01 and law.residual < 1e-3
    assert PowerLaw(1.0, 0.1, irreducible=2.0).compute_for(1.9) is None
    with pytest.raises(ValueError, match="at least two"):
        fit_power_law([1e15], [3.0])


# ------------------------------------------------------------------ curves and report formatting
def test_curves_keep_the_last_record_of_a_repeated_step(tmp_path):
    lines = [
        {"step": 1, "loss": 5.0},
        {"step": 2, "loss": 4.0},
        {"step": 3, "loss": 9.0},  # step 3 lost to a crash
        {"step": 3, "loss": 3.0},
        {"step": 4, "loss": 2.0, "tokens_per_s": 10.0},
        {"step": 4, "validation_loss": 2.5},
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + '\n{"step": 5, "lo')
    curves = read_curves(tmp_path / "metrics.jsonl")
    assert curves.steps == [1, 2, 3, 4] and curves.series["loss"] == [5.0, 4.0, 3.0, 2.0]
    assert curves.final_validation() == 2.5 and curves.final_train(2) == 2.5
    assert ema([1.0, 3.0], 0.5) == [1.0, 1.0 * 0.25 / 0.75 + 3.0 * 0.5 / 0.75]
    b = band([([1, 2, 3], [1.0, 2.0, 3.0]), ([2, 3], [4.0, 1.0])])
    assert b.x == [2, 3] and b.mean == [3.0, 2.0] and b.low == [2.0, 1.0] and b.high == [4.0, 3.0]


def test_number_formats_are_fixed_per_kind():
    assert [format_count(v) for v in (950, 1234, 5.8e9, 781_000, 2.78e12)] == [
        "950",
        "1.23 k",
        "5.80 G",
        "781 k",
        "2.78 T",
    ]
    assert format_rate(968.5134) == "969" and format_rate(1234.0) == "1,234"
    row = ArmSummary(
        size=None,
        arm="full",
        final={0: 2.0, 1: 2.2},
        final_train={},
        steps=1200,
        tokens=614_400,
        trained_flops=1.1e12,
        throughput=968.6,
        parameters=781_000,
        active_parameters=274_000,
        flops_per_token=1.9e6,
        difference=stats.Interval(-0.01, -0.03, 0.01, "Welch t", dof=3.47, seeds=3),
    )
    table = summary_table([row], "validation", 0.95)
    assert (
        "| full | 2 | 1,200 | 614 k | 2.1000 ± 0.1414 | -0.0100 [-0.0300, +0.0100] | Welch t, ν = 3.5 "
        "| not distinguishable from seed noise | 969 | 781 k | 274 k | 1.90 M | 1.10 T |"
    ) in table
    assert format_interval(None) == "(baseline)"


def test_ladder_report_fits_each_arm_and_prints_the_compute_multiplier(tmp_path):
    """Runs on disk (metrics written here) whose final losses follow L = 50·C^-0.1 for `a` and
    L = 50·(1.25·C)^-0.1 for `b`: the report's multiplier of b over a is 1.25."""
    from types import SimpleNamespace

    from k3train.ablation.runner import write_record
    from k3train.ablation.write import write_report

    small = str(CHECKOUT / "recipes" / "ladder" / "cpu-small.yaml")
    sweep = Sweep(
        recipes=[TINY, small],
        ladder=True,
        seeds=2,
        overrides=("train.steps=4", "train.eval_interval=4"),
        variants=[Variant("a", ("optimizer.lr=1e-3",)), Variant("b", ("optimizer.lr=2e-3",))],
    )
    runs = expand(sweep)
    for run in runs:
        cost = run_cost(run.recipe, run.overrides)
        loss = 50.0 * ((1.25 if run.arm == "b" else 1.0) * cost.flops) ** -0.1  # the same for every seed
        run_dir = tmp_path / run.relative_dir
        run_dir.mkdir(parents=True)
        records = [{"step": s, "loss": loss + 0.1 * (4 - s), "tokens_per_s": 1000.0} for s in range(1, 5)]
        records.append({"step": 4, "validation_loss": loss})
        (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
        write_record(run_dir, run, "done")
    (tmp_path / runs[-1].relative_dir / "ablate_run.json").unlink()  # one run unfinished: left out
    args = SimpleNamespace(window=2, confidence=0.95, no_plots=False, smooth=0.0, irreducible=False)
    path, table = write_report(sweep, runs, tmp_path, "python tools/ablate.py ...", args)
    report = path.read_text()
    assert "## Size `cpu-tiny`" in report and "## Size `cpu-small`" in report
    assert "| b | a |" in report and "| 1.250× |" in report
    assert "0.1000 |" in report  # the fitted exponent b
    assert "| b | 1 | 4 |" in report and "1 of 8 runs are not finished" in report
    assert (tmp_path / "ladder.png").stat().st_size > 0 and (tmp_path / "cpu-small-loss.png").exists()


def test_without_matplotlib_the_cli_stops_with_one_line_before_running(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # import matplotlib → ImportError
    assert ablate.main(["--recipe", TINY, "--out", str(tmp_path), "--variant", "a"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "pip install matplotlib" in error and "--no-plots" in error
    assert not any(tmp_path.iterdir())  # nothing ran
