"""Run a sweep's runs as separate training processes, several at once, resumably.

Every run lives in `OUT/<run>/` with its `train.log`, its `metrics.jsonl` and checkpoints, and
`ablate_run.json`: the recipe and overrides it was started with and its status. On a second
invocation a run whose status is `done` with the same recipe and overrides is skipped; any other
run is started again with `checkpoint.resume=auto`, so the job continues from its newest
checkpoint (the training job's own resume). A run directory made by different overrides is an
error, never silently reused. A rerun says how many runs it skips and how many continue from a
checkpoint, and each continued run's start line names the checkpoint's step; while jobs train, every `progress_s` one line per running job gives its step, planned
steps and last loss (followed from its metrics.jsonl, `k3train/ablation/progress.py`).

Threads: `N` runs at once share the cores, each process gets `cores // (N · nproc)` intra-op
threads (`train.num_threads`, and `OMP_NUM_THREADS` for anything torch starts before reading it).
With `gpus`, run slot `k` sees GPUs `k·nproc … (k+1)·nproc − 1` through `CUDA_VISIBLE_DEVICES`.
"""

from __future__ import annotations

import json
import os
import pathlib
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from io import TextIOWrapper

from k3train.ablation.grid import RunSpec
from k3train.ablation.progress import MetricsFollower, RunProgress, format_elapsed, planned_steps
from k3train.errors import UserError

CHECKOUT = pathlib.Path(__file__).resolve().parents[2]
RUN_FILE = "ablate_run.json"
RESUME_OVERRIDES = ("checkpoint.resume=auto", "checkpoint.dir=null")
"""Prepended to every run: resume from the run's own checkpoints, kept inside its directory (a
recipe's fixed `checkpoint.dir` would make all runs share one)."""


class SweepError(UserError, RuntimeError):
    """A run directory that cannot be used (made by other overrides); the message says the fix."""


@dataclass
class LaunchOptions:
    parallel: int = 1
    nproc: int = 1
    """Ranks per run: >1 starts each run under torchrun (standalone, its own free port)."""
    launcher: str | None = None
    """A full launcher command instead (e.g. 'torchrun --nnodes 2 ...'); replaces nproc's."""
    threads: int | None = None
    """Intra-op threads per rank; None: cores // (parallel · nproc)."""
    cores: int = 1
    gpus: int = 0
    wandb_group: str | None = None
    poll_s: float = 0.5
    progress_s: float | None = 30.0
    """Seconds between progress lines (one per running job); None: only start and end lines."""
    trainer: Sequence[str] = (str(CHECKOUT / "pretrain_k3.py"),)
    """The training entry point (a script path, run with this Python or under the launcher)."""

    def threads_per_rank(self, nproc: int | None = None) -> int:
        return self.threads or max(1, self.cores // (self.parallel * (nproc or self.nproc)))


@dataclass
class RunOutcome:
    spec: RunSpec
    run_dir: pathlib.Path
    status: str
    """'done', 'skipped' (done before), 'failed', 'stopped' (by a signal, checkpoint saved) or
    'not started' (a signal stopped the sweep first)."""
    returncode: int = 0
    seconds: float = 0.0


def run_record(spec: RunSpec) -> dict:
    return {
        "arm": spec.arm,
        "seed_index": spec.seed_index,
        "size": spec.size,
        "recipe": spec.recipe,
        "overrides": list(spec.overrides),
    }


def read_record(run_dir: pathlib.Path) -> dict | None:
    path = run_dir / RUN_FILE
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None  # a write cut short: treated as never started, the job's resume still applies


def write_record(run_dir: pathlib.Path, spec: RunSpec, status: str, **extra) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    temporary = run_dir / (RUN_FILE + ".tmp")
    temporary.write_text(json.dumps({**run_record(spec), "status": status, **extra}, indent=1) + "\n")
    temporary.replace(run_dir / RUN_FILE)


def is_done(run_dir: pathlib.Path, spec: RunSpec) -> bool:
    """True for a finished run of this spec; raises SweepError for a directory of another spec."""
    record = read_record(run_dir)
    if record is None:
        return False
    if record.get("recipe") != spec.recipe or record.get("overrides") != list(spec.overrides):
        raise SweepError(
            f"{run_dir} holds a run of other settings ({record.get('recipe')} "
            f"{' '.join(record.get('overrides', []))}); use another --out or delete that directory"
        )
    return record.get("status") == "done"


def checkpoint_step(run_dir: pathlib.Path) -> int | None:
    """The step of the run's newest complete checkpoint (the one `checkpoint.resume=auto` starts
    from; RESUME_OVERRIDES keep them in `run_dir/checkpoints`), None without one. Half-written
    (`.tmp_`) and damaged directories do not count: the job would not resume from them."""
    from k3train.checkpoint.manifest import complete_checkpoints  # imports torch: only when a sweep runs

    found = complete_checkpoints(run_dir / "checkpoints")
    return found[-1][0] if found else None


def at_steps(steps: Sequence[int]) -> str:
    """'at step 4', 'at steps 2, 4', 'at steps 2–40' (a range past three distinct steps)."""
    distinct = sorted(set(steps))
    if len(distinct) == 1:
        return f"at step {distinct[0]}"
    if len(distinct) <= 3:
        return "at steps " + ", ".join(str(step) for step in distinct)
    return f"at steps {distinct[0]}–{distinct[-1]}"


def resume_summary(finished: int, continuing: Sequence[int], restarting: int, fresh: int) -> str | None:
    """The line a rerun starts with (`continuing`: the checkpoint step of each run that continues);
    None for a sweep none of whose runs started before."""
    if not (finished or continuing or restarting):
        return None
    count = len(continuing)
    parts = [
        f"{finished} run{'s' if finished != 1 else ''} finished (skipped)",
        f"{count} continue{'s' if count == 1 else ''} from {'its' if count == 1 else 'their'} "
        f"checkpoint{'s' if count != 1 else ''}" + (f" ({at_steps(continuing)})" if continuing else ""),
    ]
    if restarting:
        parts.append(f"{restarting} restart{'s' if restarting == 1 else ''} from step 0 (no checkpoint saved)")
    if fresh:
        parts.append(f"{fresh} not started before")
    return "resuming: " + ", ".join(parts)


def command_for(spec: RunSpec, run_dir: pathlib.Path, options: LaunchOptions) -> list[str]:
    nproc = spec.nproc or options.nproc
    if options.launcher:
        prefix = shlex.split(options.launcher)
    elif nproc > 1:
        prefix = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    else:
        prefix = [sys.executable]
    return [
        *prefix,
        *options.trainer,
        "--recipe",
        spec.recipe,
        "--run-dir",
        str(run_dir),
        *RESUME_OVERRIDES,
        f"train.num_threads={options.threads_per_rank(spec.nproc)}",
        *spec.overrides,
        *(("logging.wandb=true",) if options.wandb_group else ()),
    ]


def environment_for(spec: RunSpec, slot: int, options: LaunchOptions) -> dict[str, str]:
    nproc = spec.nproc or options.nproc
    environment = dict(os.environ, OMP_NUM_THREADS=str(options.threads_per_rank(spec.nproc)))
    if options.gpus:  # slots are sized for the widest run
        width = max(nproc, options.nproc)
        environment["CUDA_VISIBLE_DEVICES"] = ",".join(str(slot * width + i) for i in range(nproc))
    if options.wandb_group:  # wandb.init reads these: one group per sweep, one name per run
        environment["WANDB_RUN_GROUP"] = options.wandb_group
        environment["WANDB_NAME"] = spec.arm + (f"/{spec.size}" if spec.size else "") + f"/seed{spec.seed_index}"
    return environment


STOPPED = 3
"""pretrain_k3.py's exit status after a signal it answered with a checkpoint."""


def progress_lines(runs: Sequence[RunSpec], running: dict, followers: dict[int, MetricsFollower]) -> list[str]:
    """One line per running job, in slot order, names padded so parallel jobs' columns align."""
    by_slot = sorted(running.items(), key=lambda item: item[1][1])
    width = max((len(runs[index].relative_dir) for index, _ in by_slot), default=0)
    now = time.monotonic()
    return [
        f"  {runs[index].relative_dir:<{width}}  {followers[index].progress.summary()}  "
        f"({format_elapsed(now - started)})"
        for index, (_process, _slot, started, _log) in by_slot
    ]


def run_sweep(
    runs: Sequence[RunSpec], out: pathlib.Path, options: LaunchOptions, say: Callable[[str], None] = print
) -> list[RunOutcome]:
    """Run every run not already done, `options.parallel` at a time; returns one outcome per run
    in the order given ('not started' for runs a stop left out).

    SIGTERM (a scheduler's stop) is passed on to the running jobs, which save a checkpoint and
    exit; no new run starts and the sweep returns, to be resumed by the same command. A
    KeyboardInterrupt (Ctrl-C: the terminal signals the jobs too) waits for the jobs the same way
    and re-raises."""
    widest = max([options.nproc] + [spec.nproc or 1 for spec in runs])
    if options.gpus and options.parallel * widest > options.gpus:
        raise SweepError(
            f"--parallel {options.parallel} × {widest} ranks per run needs "
            f"{options.parallel * widest} GPUs, --gpus says {options.gpus}"
        )
    outcomes: dict[int, RunOutcome] = {}
    pending: list[int] = []
    for index, spec in enumerate(runs):
        run_dir = out / spec.relative_dir
        if is_done(run_dir, spec):
            outcomes[index] = RunOutcome(spec, run_dir, "skipped")
        else:
            pending.append(index)
    continuing = {
        index: step for index in pending if (step := checkpoint_step(out / runs[index].relative_dir)) is not None
    }
    restarting = {
        index
        for index in pending
        if index not in continuing and read_record(out / runs[index].relative_dir) is not None
    }
    summary = resume_summary(
        len(runs) - len(pending),
        list(continuing.values()),
        len(restarting),
        len(pending) - len(continuing) - len(restarting),
    )
    if summary:
        say(summary)
    running: dict[int, tuple[subprocess.Popen, int, float, TextIOWrapper]] = {}
    followers: dict[int, MetricsFollower] = {}
    last_progress = time.monotonic()
    free_slots = list(range(options.parallel))
    stop_signals: list[int] = []

    def pass_on(signum, frame) -> None:
        stop_signals.append(signum)
        for process, *_rest in running.values():
            if process.poll() is None:
                process.send_signal(signum)

    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, pass_on)
    try:
        while pending or running:
            while pending and free_slots and not stop_signals:
                index = pending.pop(0)
                spec, slot = runs[index], free_slots.pop(0)
                run_dir = out / spec.relative_dir
                write_record(run_dir, spec, "running")
                log = open(run_dir / "train.log", "a")
                how = (
                    f"continue {spec.relative_dir} from its checkpoint at step {continuing[index]}"
                    if index in continuing
                    else f"start {spec.relative_dir}"
                )
                say(f"{how}: {' '.join(spec.overrides)}")
                followers[index] = MetricsFollower(run_dir / "metrics.jsonl", RunProgress(planned_steps(spec)))
                process = subprocess.Popen(
                    command_for(spec, run_dir, options),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=environment_for(spec, slot, options),
                )
                running[index] = (process, slot, time.monotonic(), log)
            if stop_signals and not running:
                break
            time.sleep(options.poll_s)
            for follower in followers.values():
                follower.poll()
            # before finished jobs are reaped, so even a job shorter than progress_s is shown once it ends
            if options.progress_s is not None and time.monotonic() - last_progress >= options.progress_s:
                last_progress = time.monotonic()
                for line in progress_lines(runs, running, followers):
                    say(line)
            for index in [i for i, (process, *_rest) in running.items() if process.poll() is not None]:
                process, slot, started, log = running.pop(index)
                log.close()
                free_slots.append(slot)
                spec, run_dir = runs[index], out / runs[index].relative_dir
                seconds = time.monotonic() - started
                if process.returncode == 0:
                    status = "done"
                elif process.returncode == STOPPED and stop_signals:
                    status = "stopped"
                else:
                    status = "failed"
                write_record(run_dir, spec, status, returncode=process.returncode, seconds=round(seconds, 1))
                outcomes[index] = RunOutcome(spec, run_dir, status, process.returncode, seconds)
                progress = followers.pop(index).progress
                tail = "" if status == "done" else f" (exit {process.returncode}; see {run_dir / 'train.log'})"
                say(f"{status} {spec.relative_dir} in {format_elapsed(seconds)}: {progress.summary()}{tail}")
    except KeyboardInterrupt:
        for process, *_rest in running.values():
            try:
                process.wait(timeout=120)  # the job saves a checkpoint on SIGINT and exits 3
            except subprocess.TimeoutExpired:
                process.terminate()
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    for index in pending:
        outcomes[index] = RunOutcome(runs[index], out / runs[index].relative_dir, "not started")
    return [outcomes[index] for index in range(len(runs))]
