"""k3train/ablation/runner.py: parallel runs, resume of an interrupted sweep, and one real sweep.

The resume test drives the runner with a stand-in trainer (a few lines of Python that write
metrics and checkpoint directories (empty, but in the layout and with the completeness marks
of k3train/checkpoint/manifest.py) the way pretrain_k3.py does, and can be told to crash), so
it checks the runner's bookkeeping in a second; the last test runs pretrain_k3.py itself for two
steps per run to check the whole path (tools/ablate.py → runs → report)."""

import importlib.util
import json
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from k3train.ablation.curves import read_curves
from k3train.ablation.grid import Sweep, Variant, expand
from k3train.ablation.progress import MetricsFollower, RunProgress
from k3train.ablation.runner import RUN_FILE, LaunchOptions, SweepError, command_for, resume_summary, run_sweep

CHECKOUT = pathlib.Path(__file__).resolve().parents[2]
TINY = str(CHECKOUT / "recipes" / "ladder" / "cpu-tiny.yaml")

FAKE_TRAINER = textwrap.dedent("""
    import json, os, pathlib, signal, sys, time
    stop = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))
    args = sys.argv[1:]
    run_dir = pathlib.Path(args[args.index("--run-dir") + 1])
    overrides = dict(a.split("=", 1) for a in args if "=" in a and not a.startswith("--"))
    steps = int(overrides["train.steps"])
    checkpoints = run_dir / "checkpoints"

    def save(step):
        saved = checkpoints / f"step_{step:08d}"
        saved.mkdir(parents=True, exist_ok=True)
        (saved / ".metadata").write_text("")
        (saved / "k3train.json").write_text(json.dumps({"step": step, "complete": True}))

    complete = sorted(int(d.name[5:]) for d in checkpoints.glob("step_*") if (d / "k3train.json").exists())
    start = complete[-1] if overrides.get("checkpoint.resume") == "auto" and complete else 0
    with open(run_dir / "starts.txt", "a") as starts:
        starts.write(f"{start} threads={overrides['train.num_threads']} omp={os.environ['OMP_NUM_THREADS']}\\n")
    crash_at = run_dir / "crash_at"
    with open(run_dir / "metrics.jsonl", "a") as metrics:
        for step in range(start + 1, steps + 1):
            loss = 5.0 - 0.1 * step + 0.01 * int(overrides["train.seed"])
            metrics.write(json.dumps({"step": step, "loss": loss, "tokens_per_s": 100.0}) + "\\n")
            metrics.flush()
            if step % 2 == 0:
                save(step)
            if crash_at.exists() and step == int(crash_at.read_text()):
                crash_at.unlink()
                sys.exit(1)
            time.sleep(float(os.environ.get("FAKE_STEP_S", "0")))
            if stop:  # as pretrain_k3.py: finish the step, save, exit 3
                save(step)
                sys.exit(3)
        metrics.write(json.dumps({"step": steps, "validation_loss": loss}) + "\\n")
""")


def test_interrupted_sweep_skips_finished_runs_and_resumes_the_others(tmp_path):
    trainer = tmp_path / "fake_trainer.py"
    trainer.write_text(FAKE_TRAINER)
    sweep = Sweep(
        recipes=[TINY],
        variants=[Variant("a"), Variant("b", ("model.attn_res=none",))],
        seeds=2,
        overrides=("train.steps=6",),
    )
    runs = expand(sweep)
    out = tmp_path / "out"
    options = LaunchOptions(parallel=2, cores=4, poll_s=0.05, progress_s=0.0, trainer=(str(trainer),))
    crashing = out / "b" / "seed1"
    crashing.mkdir(parents=True)
    (crashing / "crash_at").write_text("5")  # dies after step 5; its newest checkpoint is step 4

    said: list[str] = []
    first = run_sweep(runs, out, options, say=said.append)
    assert [o.status for o in first] == ["done", "done", "done", "failed"]
    assert json.loads((crashing / RUN_FILE).read_text())["status"] == "failed"
    assert not any(line.startswith("resuming") for line in said)  # a fresh sweep resumes nothing
    # progress_s=0: a line per running job at every poll; every job is polled at least once after
    # its last step (progress is printed before finished jobs are reaped)
    assert any(line.split()[:3] == ["a/seed0", "step", "6/6"] and "loss 16.7400" in line for line in said), said
    assert any(line.startswith("done a/seed0") and "step 6/6" in line for line in said)

    said.clear()
    second = run_sweep(runs, out, options, say=said.append)
    assert [o.status for o in second] == ["skipped", "skipped", "skipped", "done"]
    assert said[0] == "resuming: 3 runs finished (skipped), 1 continues from its checkpoint (at step 4)"
    assert any(line.startswith("continue b/seed1 from its checkpoint at step 4: ") for line in said), said
    # the finished runs started once; the crashed one again, from its checkpoint at step 4
    assert (out / "a" / "seed0" / "starts.txt").read_text() == "0 threads=2 omp=2\n"
    assert [line.split()[0] for line in (crashing / "starts.txt").read_text().splitlines()] == ["0", "4"]
    curves = read_curves(crashing / "metrics.jsonl")  # step 5 was written twice: kept once
    assert curves.steps == [1, 2, 3, 4, 5, 6] and curves.final_validation() is not None

    changed = expand(
        Sweep(recipes=[TINY], variants=[Variant("a", ("optimizer.lr=1e-4",))], overrides=("train.steps=6",))
    )
    with pytest.raises(SweepError, match="other settings"):
        run_sweep(changed, out, options, say=lambda line: None)


@pytest.mark.timeout(120)
def test_sigterm_stops_the_sweep_with_checkpoints_and_the_same_sweep_resumes(tmp_path):
    trainer = tmp_path / "fake_trainer.py"
    trainer.write_text(FAKE_TRAINER)
    out = tmp_path / "out"
    driver = textwrap.dedent(f"""
        import os, pathlib, sys
        from k3train.ablation.grid import Sweep, Variant, expand
        from k3train.ablation.runner import LaunchOptions, run_sweep
        os.environ["FAKE_STEP_S"] = "0.05"
        runs = expand(Sweep(recipes=[{TINY!r}], variants=[Variant("a"), Variant("b")], overrides=("train.steps=400",)))
        options = LaunchOptions(parallel=1, cores=1, poll_s=0.05, trainer=({str(trainer)!r},))
        print(" ".join(o.status for o in run_sweep(runs, pathlib.Path({str(out)!r}), options, say=lambda line: None)))
    """)
    process = subprocess.Popen([sys.executable, "-c", driver], stdout=subprocess.PIPE, text=True)
    metrics = out / "a" / "seed0" / "metrics.jsonl"
    deadline = time.monotonic() + 60
    while (not metrics.exists() or len(metrics.read_text().splitlines()) < 3) and time.monotonic() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    stdout, _ = process.communicate(timeout=60)
    assert process.returncode == 0 and stdout.split() == ["stopped", "not", "started"]
    record = json.loads((out / "a" / "seed0" / RUN_FILE).read_text())
    assert record["status"] == "stopped" and record["returncode"] == 3
    saved = max(int(d.name[5:]) for d in (out / "a" / "seed0" / "checkpoints").glob("step_*"))
    assert 3 <= saved < 400 and not (out / "b").exists()

    runs = expand(Sweep(recipes=[TINY], variants=[Variant("a"), Variant("b")], overrides=("train.steps=400",)))
    outcomes = run_sweep(runs, out, LaunchOptions(poll_s=0.05, trainer=(str(trainer),)), say=lambda line: None)
    assert [o.status for o in outcomes] == ["done", "done"]
    assert [int(line.split()[0]) for line in (out / "a" / "seed0" / "starts.txt").read_text().splitlines()] == [
        0,
        saved,
    ]
    assert read_curves(metrics).steps == list(range(1, 401))


def test_resume_line_counts_finished_continuing_restarting_and_new_runs():
    assert resume_summary(0, [], 0, 4) is None
    assert resume_summary(3, [40, 20], 0, 0) == (
        "resuming: 3 runs finished (skipped), 2 continue from their checkpoints (at steps 20, 40)"
    )
    assert resume_summary(0, [10, 20, 30, 40], 0, 0).endswith("4 continue from their checkpoints (at steps 10–40)")
    assert resume_summary(1, [], 1, 2) == (
        "resuming: 1 run finished (skipped), 0 continue from their checkpoints, "
        "1 restarts from step 0 (no checkpoint saved), 2 not started before"
    )


def test_only_a_complete_checkpoint_counts_for_resuming(tmp_path):
    """A half-written or damaged checkpoint directory is not one the job resumes from."""
    from k3train.ablation.runner import checkpoint_step

    checkpoints = tmp_path / "checkpoints"
    assert checkpoint_step(tmp_path) is None
    (checkpoints / ".tmp_step_00000008").mkdir(parents=True)
    (checkpoints / "step_00000006.damaged-checksum").mkdir()
    (checkpoints / "step_00000004").mkdir()  # no .metadata, no manifest: cut short
    assert checkpoint_step(tmp_path) is None
    for step in (2, 4):
        (checkpoints / f"step_{step:08d}").mkdir(exist_ok=True)
        (checkpoints / f"step_{step:08d}" / ".metadata").write_text("")
        (checkpoints / f"step_{step:08d}" / "k3train.json").write_text(json.dumps({"step": step, "complete": True}))
    assert checkpoint_step(tmp_path) == 4


def test_metrics_follower_reads_only_complete_appended_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    follower = MetricsFollower(path, RunProgress(planned_steps=10))
    assert follower.poll().summary() == "step 0/10 (0%)"  # no file yet
    path.write_text(json.dumps({"step": 1, "loss": 5.0}) + "\n" + '{"step": 2, "lo')
    assert follower.poll().step == 1  # the half-written line waits
    with open(path, "a") as metrics:
        metrics.write('ss": 4.5}\n' + json.dumps({"step": 2, "validation_loss": 4.75}) + "\n")
    assert follower.poll().summary() == "step 2/10 (20%), loss 4.5000, val 4.7500"
    path.write_text(json.dumps({"step": 1, "loss": 6.0}) + "\n")  # replaced by a shorter file: reread
    assert follower.poll().loss == 6.0


def test_commands_threads_and_gpus_per_slot(tmp_path):
    spec = expand(Sweep(recipes=[TINY], variants=[Variant("a", ("train.steps=3",))]))[0]
    options = LaunchOptions(parallel=2, nproc=2, cores=16)
    command = command_for(spec, tmp_path, options)
    assert command[:5] == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    assert "train.num_threads=4" in command and command[-1] == "train.steps=3"
    assert command.index("checkpoint.resume=auto") < command.index("train.steps=3")  # a run may still override it
    from k3train.ablation.runner import environment_for

    assert environment_for(spec, 1, LaunchOptions(parallel=2, nproc=2, gpus=4))["CUDA_VISIBLE_DEVICES"] == "2,3"
    grouped = LaunchOptions(wandb_group="attn-res")
    environment = environment_for(spec, 0, grouped)
    assert environment["WANDB_RUN_GROUP"] == "attn-res" and environment["WANDB_NAME"] == "a/seed0"
    assert command_for(spec, tmp_path, grouped)[-1] == "logging.wandb=true"
    wide = expand(Sweep(recipes=[TINY], variants=[Variant("tp2", ("parallel.tp=2",), nproc=2)]))[0]
    assert "--nproc_per_node=2" in command_for(wide, tmp_path, LaunchOptions(parallel=1, cores=8))
    assert "train.num_threads=4" in command_for(wide, tmp_path, LaunchOptions(parallel=1, cores=8))
    with pytest.raises(SweepError, match="needs 6 GPUs"):
        run_sweep([spec], tmp_path, LaunchOptions(parallel=3, nproc=2, gpus=4))


@pytest.mark.timeout(600)
def test_a_real_two_step_sweep_writes_its_report_and_resumes_as_a_no_op(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("ablate_cli", CHECKOUT / "tools" / "ablate.py")
    ablate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ablate)
    argv = [
        "--recipe",
        TINY,
        "--out",
        str(tmp_path),
        "--variant",
        "none",
        "model.attn_res=none",
        "--variant",
        "block",
        "--seeds",
        "1",
        "--parallel",
        "2",
        "--",
        "train.steps=2",
        "train.eval_interval=2",
        "train.eval_batches=1",
        "checkpoint.interval=0",
    ]
    assert ablate.main(argv) == 0
    report = (tmp_path / "report.md").read_text()
    assert "| none | 1 | 2 | 1.02 k |" in report and "(1 seed) | (baseline)" in report  # 2 steps of 512 tokens
    assert "(no interval) | – | too few seeds to tell (n=1; need ≥ 3) |" in report
    assert "1 seed: no band" in report and "band: min–max" not in report
    for plot in ("loss.png", "loss_difference.png", "experts.png", "grad_norm_throughput.png"):
        assert (tmp_path / plot).stat().st_size > 0 and f"({plot})" in report
    logs = {p: p.stat().st_mtime for p in tmp_path.glob("*/seed*/train.log")}
    assert len(logs) == 2
    capsys.readouterr()
    assert ablate.main(argv) == 0  # everything finished: nothing runs, the report is rewritten
    assert "resuming: 2 runs finished (skipped), 0 continue from their checkpoints" in capsys.readouterr().out
    assert {p: p.stat().st_mtime for p in logs} == logs
