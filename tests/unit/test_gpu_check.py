"""tools/gpu_check.py as the device run uses it, here on the CPU at small sizes: it exits 0 and its
table has a row for every registered check (SKIP only where a check needs CUDA, fla or several
GPUs); and the fla-only rows' logic, with the PyTorch path standing in for fla's kernel."""

import importlib
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import time

from k3train.benchmarking.gpu_checks.budget import RESERVE_S

CHECKOUT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = CHECKOUT / "tools" / "gpu_check.py"
# Checks that cannot run on a CPU: their rows may SKIP; every other row must PASS.
CUDA_ONLY = {
    "kda_fla",
    "kda_speed",
    "kda_fla_raw",
    "short_conv_fla",
    "gated_norm_fla",
    "model_large",
    "expert_dispatch",
    "device_splits",
    "transformer_engine",
    "k3_1gpu",
}


def load_gpu_check():
    """The script as a module (tools/ is no package)."""
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up while the file executes
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules["gpu_check"]
    return module


def check_module(name: str):
    """k3train/benchmarking/gpu_checks/<name>.py, the module the script imported: stand-ins are
    patched there, where the checks look them up."""
    return importlib.import_module(f"k3train.benchmarking.gpu_checks.{name}")


def table_rows(stdout: str) -> list[list[str]]:
    """The cells of the final table's rows (after its header and rule)."""
    lines = stdout.splitlines()
    header = max(i for i, line in enumerate(lines) if line.startswith("| check "))
    return [
        [cell.strip() for cell in line.strip("|").split(" | ")] for line in lines[header + 2 :] if line.startswith("| ")
    ]


def test_gpu_check_runs_on_cpu():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--budget", "120"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=CHECKOUT,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    budget_lines = [line for line in result.stdout.splitlines() if line.startswith("gpu_check: budget 120 s")]
    assert len(budget_lines) == 1, result.stdout[-2000:]  # the run says what it left out (here: nothing)

    rows = table_rows(result.stdout)
    statuses: dict[str, set[str]] = {}
    for cells in rows:
        statuses.setdefault(cells[0].split()[0], set()).add(cells[4])
    checks = [check.name for check in load_gpu_check().CHECKS]
    assert set(checks) == set(statuses), (checks, sorted(statuses))
    assert CUDA_ONLY <= set(checks)
    for name in checks:
        allowed = {"PASS", "SKIP"} if name in CUDA_ONLY else {"PASS"}
        assert statuses[name] <= allowed, (name, statuses[name], result.stdout[-4000:])


def test_fla_rows_with_a_stand_in_kernel(monkeypatch, capsys):
    # No CUDA here: backend="fla" is served by the PyTorch path, so kda_fla and kda_speed run
    # their comparison and timing code instead of printing SKIP.
    gpu_check = load_gpu_check()
    kda_checks = check_module("kda")
    chunk_kda = kda_checks.chunk_kda
    monkeypatch.setattr(
        kda_checks, "chunk_kda", lambda *args, backend, **kwargs: chunk_kda(*args, backend="torch", **kwargs)
    )
    monkeypatch.setattr(kda_checks, "fla_unavailable_reason", lambda ctx: None)
    assert gpu_check.main(["--device", "cpu", "--quick", "--only", "kda_fla", "--only", "kda_speed"]) == 0
    rows = table_rows(capsys.readouterr().out)
    assert [(cells[0], cells[4]) for cells in rows] == [
        ("kda_fla fp32", "PASS"),
        ("kda_fla bf16", "PASS"),
        ("kda_speed T=128", "PASS"),
    ]


def test_transformer_engine_and_k3_1gpu_rows_with_a_stand_in(monkeypatch, capsys, tmp_path):
    # No CUDA and no Transformer Engine here: the CPU stand-in (tests/unit/te_stand_in.py, TE's
    # signatures with exact GEMMs) serves, so the TE rows, the fp8 training run, the loss-curve
    # comparison and the throughput table run their code instead of printing SKIP.
    from k3train.kernels import te as te_kernels
    from tests.unit.te_stand_in import make_stand_in

    gpu_check = load_gpu_check()
    te = make_stand_in()
    # The k3_1gpu check asks the transformer_engine module too, so one patch serves both checks.
    te_checks = check_module("transformer_engine")
    monkeypatch.setattr(te_checks, "te_unavailable_reason", lambda ctx: (te, None))
    monkeypatch.setattr(te_checks, "fp8_recipes_here", lambda ctx: ["delayed", "current"])
    monkeypatch.setattr(te_kernels, "import_transformer_engine", lambda: (te, ""))
    json_path = tmp_path / "gpu_check.json"
    code = gpu_check.main(
        ["--device", "cpu", "--quick", "--only", "transformer_engine", "--only", "k3_1gpu", "--json", str(json_path)]
    )
    report = json.loads(json_path.read_text())
    rows = {cells[0]: cells[4] for cells in table_rows(capsys.readouterr().out)}
    assert code == 0 and set(rows.values()) == {"PASS"}, rows
    assert {
        "transformer_engine names",
        "transformer_engine fp8 state",
        "transformer_engine grouped current",
        "transformer_engine linear 1536x12 delayed",
        "k3_1gpu loss fp8-vs-bf16",
        "k3_1gpu speed fp8 attn_res=none",
    } <= set(rows)
    table = report["k3_1gpu"]["throughput"]
    assert {(row["precision"], row["attn_res"]) for row in table} == {
        ("bf16", "block"),
        ("fp8", "block"),
        ("bf16", "none"),
        ("fp8", "none"),
    }
    # bf16 resolves model.linear_backend=auto (torch without CUDA); fp8 always runs on TE.
    assert all(
        row["linear_backend"] == {"bf16": "torch", "fp8": "te"}[row["precision"]] and row["tokens_per_s"] > 0
        for row in table
    )
    assert len(report["k3_1gpu"]["loss_curves"]["fp8/block"]) == 5
    # the recipe's step: its micro-batches of forward-backward and one optimizer step, timed apart
    for row in table:
        assert row["micro_batches"] == 32 and row["timed_steps"] >= 3, row
        # each value is rounded to 0.01 ms: 32 × 0.005 + 0.005 + 0.005 = 0.17 ms at most
        assert abs(row["step_ms"] - (32 * row["model_ms"] + row["optimizer_ms"])) < 0.2, row
    assert set(report["seconds"]) == {"transformer_engine", "k3_1gpu"} and report["left_out"] == []


def test_loss_curve_comparison():
    load_gpu_check()
    k3_1gpu = check_module("k3_1gpu")
    worst, tail = k3_1gpu.compare_loss_curves([10.0, 8.0, 6.0, 4.0], [10.0, 8.8, 6.0, 4.2], tail=2)
    assert abs(worst - 0.1) < 1e-12 and abs(tail - 0.025) < 1e-12
    assert k3_1gpu.compare_loss_curves([1.0, 2.0], [1.0]) == (float("inf"), float("inf"))


def test_without_a_gpu_it_says_so_in_one_line_and_exits_2():
    """The default is CUDA: on a machine without it the script answers at once (it used to run
    every check on the CPU at full sizes for minutes)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    for args in ([], ["--device", "cuda", "--only", "kda_chunk"]):
        result = subprocess.run(
            [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120, env=env, cwd=CHECKOUT
        )
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert result.returncode == 2 and result.stdout == "", result.stdout[-2000:] + result.stderr[-2000:]
        assert len(lines) == 1 and lines[0].startswith("gpu_check: no GPU:") and "--device cpu" in lines[0], lines


def fake_check(gpu_check, name: str, group: str, estimate: float, log: list[str]):
    """A registry entry whose run records that it ran and yields a PASS row."""

    def run(ctx):
        log.append(name)
        yield gpu_check.Row(f"{name} 0", "PASS")

    return gpu_check.Check(name, run, group, (estimate, estimate, estimate))


def test_checks_are_registered_in_the_order_of_their_groups():
    gpu_check = load_gpu_check()
    order = list(gpu_check.GROUPS)
    ranks = [order.index(check.group) for check in gpu_check.CHECKS]
    assert ranks == sorted(ranks) and set(ranks) == set(range(len(order)))
    assert [c.name for c in gpu_check.CHECKS if c.group == "first"][-1] == "k3_1gpu"


def test_budget_leaves_out_what_does_not_fit_and_a_second_call_takes_the_rest(monkeypatch, capsys, tmp_path):
    """Estimates decide (no clock is read for it): with 60 s, the 1000 s check is left out, the
    cheaper checks after it still run, and the printed command runs exactly what was left out.
    `--estimates` replaces the built-in estimates with a previous run's measured seconds."""
    gpu_check = load_gpu_check()
    log: list[str] = []
    checks = [
        fake_check(gpu_check, "valuable", "first", 1, log),
        fake_check(gpu_check, "huge", "paths", 1000, log),
        fake_check(gpu_check, "cheap", "speed", 1, log),
    ]
    monkeypatch.setattr(gpu_check, "CHECKS", checks)
    json_path = tmp_path / "first.json"
    assert gpu_check.main(["--device", "cpu", "--budget", "60", "--json", str(json_path)]) == 0
    out = capsys.readouterr().out
    assert log == ["valuable", "cheap"]
    assert "[huge] left out: estimated 1000 s" in out
    rest = [line for line in out.splitlines() if line.startswith("gpu_check: the rest: ")]
    assert rest == ["gpu_check: the rest: python tools/gpu_check.py --device cpu --only huge"], out[-2000:]
    report = json.loads(json_path.read_text())
    assert report["left_out"] == ["huge"] and set(report["seconds"]) == {"valuable", "cheap"}

    log.clear()
    argv = rest[0].split("python tools/gpu_check.py ")[1].split()
    assert gpu_check.main([*argv, "--budget", "60", "--estimates", str(tmp_path / "measured.json")]) == 2  # absent
    (tmp_path / "measured.json").write_text(json.dumps({"seconds": {"huge": 2.0}}))
    assert gpu_check.main([*argv, "--budget", "60", "--estimates", str(tmp_path / "measured.json")]) == 0
    assert log == ["huge"] and "nothing left out" in capsys.readouterr().out

    log.clear()
    assert gpu_check.main(["--device", "cpu", "--skip", "valuable", "--skip", "huge"]) == 0
    assert log == ["cheap"]


def test_a_check_that_overruns_is_stopped_at_the_budget(monkeypatch, capsys):
    """A check whose estimate fits but which runs on is stopped when the budget ends: its rows so
    far stay, it and everything after it are named as left out, and the run exits cleanly."""
    gpu_check = load_gpu_check()
    log: list[str] = []

    def endless(ctx):
        log.append("endless")
        yield gpu_check.Row("endless 0", "PASS")
        while True:  # only the budget's timer ends this
            time.sleep(0.01)

    checks = [
        fake_check(gpu_check, "first_one", "first", 0, log),
        gpu_check.Check("endless", endless, "paths", (0, 0, 0)),
        fake_check(gpu_check, "after", "speed", 0, log),
    ]
    monkeypatch.setattr(gpu_check, "CHECKS", checks)
    budget_s = RESERVE_S + 1.0  # one second for the checks
    assert gpu_check.main(["--device", "cpu", "--budget", str(budget_s)]) == 0
    out = capsys.readouterr().out
    rows = {cells[0]: (cells[4], cells[-1]) for cells in table_rows(out)}
    assert log == ["first_one", "endless"]
    assert rows["endless 0"][0] == "PASS" and rows["endless"][0] == "SKIP" and "budget" in rows["endless"][1]
    assert "left out 2 check(s)" in out and "--only endless --only after" in out
