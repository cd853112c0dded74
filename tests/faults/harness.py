"""Launch pretrain_k3.py as an operator would, hurt it, and watch how it ends.

Every launch runs in its own session with its output in files (no pipe can fill up and block
it) and has a deadline: a job that hangs fails the test instead of stalling CI, and the whole
process group is killed. A tiny model keeps a launch to seconds; each scenario asserts the exit
status, the one-line message, the newest complete checkpoint, and where it applies a resume
whose losses equal an uninterrupted run's bit for bit.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

CHECKOUT = pathlib.Path(__file__).resolve().parents[2]
STEPS = 6
# A tiny model (two layers: one dense KDA, one MoE MLA) on a few tokens: a step takes a fraction
# of a second, so the scenarios are about start-up, signals and files, not arithmetic.
TINY = [
    "model.hidden_size=64",
    "model.num_hidden_layers=2",
    "model.num_experts=4",
    "model.num_experts_per_token=2",
    "model.linear_attn_config.head_dim=16",
    "model.routed_expert_hidden_size=32",
    "data.seq_length=16",
    "train.global_batch_size=4",
    "train.micro_batch_size=1",
    "train.eval_interval=0",
    "schedule.warmup_steps=2",
    f"train.steps={STEPS}",
    "checkpoint.interval=2",
    "checkpoint.keep_last=5",
]
LAUNCH_TIMEOUT_S = 240.0


def job_args(run_dir: pathlib.Path, *overrides: str) -> list[str]:
    return [
        str(CHECKOUT / "pretrain_k3.py"),
        "--recipe",
        str(CHECKOUT / "recipes/debug.yaml"),
        "--run-dir",
        str(run_dir),
        *TINY,
        *overrides,
    ]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class Launch:
    """One process of a job (a single-process run, a torchrun agent, or one rank)."""

    process: subprocess.Popen
    stdout_path: pathlib.Path
    stderr_path: pathlib.Path
    started: float

    @property
    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def error_lines(self) -> list[str]:
        """The lines a user reads on stderr (torch's own warnings filtered out)."""
        return [line for line in self.stderr.splitlines() if line.startswith("error:")]

    def wait_for(self, pattern: str, timeout_s: float = LAUNCH_TIMEOUT_S) -> None:
        """Until `pattern` appears on stdout (fails if the process ends or the deadline passes)."""
        deadline = time.monotonic() + timeout_s
        while not re.search(pattern, self.stdout):
            if self.process.poll() is not None:
                raise AssertionError(
                    f"exited {self.process.returncode} before {pattern!r}:\n"
                    f"{self.stdout[-1500:]}\n{self.stderr[-3000:]}"
                )
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"no {pattern!r} within {timeout_s:.0f}s:\n{self.stdout[-1500:]}")
            time.sleep(0.05)

    def finish(self, timeout_s: float = LAUNCH_TIMEOUT_S) -> int:
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"still running after {timeout_s:.0f}s:\n{self.stdout[-1500:]}\n{self.stderr[-1500:]}"
            ) from None

    def signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    def kill(self) -> None:
        """SIGKILL this launch's whole session (a torchrun agent's workers included)."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(timeout=30)


def launch(args: list[str], log_dir: pathlib.Path, name: str, env_extra: dict[str, str] | None = None) -> Launch:
    log_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env_extra or {}))
    stdout_path, stderr_path = log_dir / f"{name}.out", log_dir / f"{name}.err"
    with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
        process = subprocess.Popen(
            [sys.executable, *args], stdout=out, stderr=err, env=env, cwd=CHECKOUT, start_new_session=True
        )
    return Launch(process, stdout_path, stderr_path, time.monotonic())


def single(run_dir: pathlib.Path, *overrides: str, env_extra: dict[str, str] | None = None) -> Launch:
    return launch(job_args(run_dir, *overrides), run_dir.parent / "logs", run_dir.name, env_extra)


def two_ranks(run_dir: pathlib.Path, *overrides: str, env_extra: dict[str, str] | None = None) -> list[Launch]:
    """Two ranks started directly (torchrun's environment without its agent, which would kill
    the survivor as soon as one rank dies and hide its own reaction)."""
    port = str(free_port())
    return [
        launch(
            job_args(run_dir, *overrides),
            run_dir.parent / "logs",
            f"{run_dir.name}.rank{rank}",
            dict(
                env_extra or {},
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE="2",
                LOCAL_WORLD_SIZE="2",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
            ),
        )
        for rank in range(2)
    ]


def torchrun(run_dir: pathlib.Path, *overrides: str) -> Launch:
    return launch(
        ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *job_args(run_dir, *overrides)],
        run_dir.parent / "logs",
        f"{run_dir.name}.torchrun",
    )


def launched(run_dir: pathlib.Path, *overrides: str) -> Launch:
    """Two ranks under tools/launch.py (torchrun's agent with the job's exit statuses)."""
    return launch(
        [str(CHECKOUT / "tools/launch.py"), "--standalone", "--nproc_per_node", "2", *job_args(run_dir, *overrides)],
        run_dir.parent / "logs",
        f"{run_dir.name}.launch",
    )


def finish_all(launches: list[Launch], timeout_s: float = LAUNCH_TIMEOUT_S) -> list[int]:
    try:
        return [launch_.finish(timeout_s) for launch_ in launches]
    finally:
        for launch_ in launches:
            if launch_.process.poll() is None:
                launch_.kill()


def losses(run_dir: pathlib.Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def complete_checkpoints(run_dir: pathlib.Path) -> list[int]:
    """Steps of the complete checkpoints, oldest first, as the job's own resume sees them."""
    from k3train.checkpoint import Checkpointer

    return [step for step, _ in Checkpointer(run_dir / "checkpoints").checkpoints()]
