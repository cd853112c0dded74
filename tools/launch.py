#!/usr/bin/env python
"""torchrun with the job's own endings: the same arguments and the same agent
(torch.distributed.run), but the launcher exits with the ranks' status (docs/failures.md) and
adds nothing to the one line they print.

    python tools/launch.py --standalone --nproc_per_node=4 pretrain_k3.py --recipe recipes/debug.yaml parallel.dp=4

Plain torchrun ends every non-zero rank exit with its ChildFailedError (a traceback and a
~40-line summary, status 1) and a SIGINT/SIGTERM to itself with a SignalException traceback
(status 1), however the ranks ended; on a signal it also gives the ranks only
TORCH_ELASTIC_SHUTDOWN_TIMEOUT (30 s) to save before it kills them. Here:

- a rank ends with a non-zero status: the launcher exits with the status of the first rank that
  ended (the rank has printed its line); a rank killed by a signal N (the OOM killer's SIGKILL)
  is reported in its place, with a line from the launcher and status 128 + N (the survivors
  print their "a peer rank died" line, status 5, docs/failures.md);
- SIGINT or SIGTERM (Ctrl-C, a scheduler): forwarded to every rank at once, as torchrun does;
  the ranks save a checkpoint at the end of the step and exit 3. The launcher waits for them
  without a deadline (a second signal is forwarded too: the ranks then exit 4 without saving)
  and exits with the highest status of its ranks; the agent then shuts down as on torchrun's
  own signal path (no restart);
- the agent's log (its banner, warnings and failure summaries) is hidden: `LOGLEVEL=WARNING`,
  torchrun's own variable, shows it.

Waiting for the ranks reads their exit statuses without reaping them (`waitid(WNOWAIT)`) and
finds them as this process's children in /proc, so that part needs Linux; elsewhere a signal
takes torchrun's own path and the launcher exits 128 + N.
"""

from __future__ import annotations

import logging
import os
import pathlib
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import FrameType

from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.run import parse_args, run

STOPPED_UNSAVED = 4
"""docs/failures.md: stopped by a signal without saving (here: before any rank had started)."""
LAUNCHER_FAILED = 1
"""The agent itself failed (rendezvous, bad torchrun arguments): not a status of the job."""
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def exit_status(code: int) -> int:
    """A Popen-style return code (negative: killed by that signal) as a shell exit status."""
    return code if code >= 0 else 128 - code


def child_processes(parent: int) -> list[int]:
    """The direct children of `parent` (the ranks: torch starts each in its own session), from
    /proc; empty where there is no /proc."""
    children = []
    for entry in pathlib.Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")".
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 1 and fields[1] == str(parent):
            children.append(int(entry.name))
    return sorted(children)


def wait_without_reaping(pids: Sequence[int], poll_s: float = 0.05) -> dict[int, int]:
    """Each pid's return code (negative for a signal) once all have exited, leaving them
    unreaped: torch's agent reaps its ranks itself and must still find their codes."""
    codes: dict[int, int] = {}
    while len(codes) < len(pids):
        for pid in pids:
            if pid in codes:
                continue
            try:
                info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT | os.WNOHANG)
            except ChildProcessError:  # reaped already (not ours to wait for): nothing to report
                codes[pid] = 0
                continue
            if info is not None:
                codes[pid] = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
        if len(codes) < len(pids):
            time.sleep(poll_s)
    return codes


def reported_failure(failed: ChildFailedError) -> tuple[int, ProcessFailure]:
    """The rank whose ending the launcher reports: one killed by a signal if any (it could not
    say why, and the others' "a peer died" lines follow from it), else torch's root cause, the
    first to end. SIGTERM and SIGINT do not count: the agent sends them to the other ranks once
    one has ended."""
    agents_signals = {-signal.SIGTERM, -signal.SIGINT}
    killed = sorted(
        rank
        for rank, failure in failed.failures.items()
        if failure.exitcode < 0 and failure.exitcode not in agents_signals
    )
    if killed:
        return killed[0], failed.failures[killed[0]]
    return failed.get_first_failure()


class RanksStopped(SignalException):
    """torch's agent takes this for its own SignalException (it shuts down, without restarting
    the ranks); it carries the codes the ranks exited with."""

    def __init__(self, signum: int, codes: dict[int, int]) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}", sigval=signal.Signals(signum))
        self.codes = codes


@dataclass
class SignalForwarder:
    """The handler of SIGINT and SIGTERM in the launcher: forward to the ranks, wait for them,
    then raise `RanksStopped` into the agent. A signal while it waits is forwarded as well."""

    forwarded_to: list[int] = field(default_factory=list)

    def install(self, args) -> None:
        """Take SIGINT and SIGTERM over from torch's agent (torchrun's `--signals-to-handle`,
        which the agent turns into its SignalException) and handle them here."""
        taken = {signal.Signals(s).name for s in FORWARDED_SIGNALS}
        names = [name.strip() for name in args.signals_to_handle.split(",")]
        args.signals_to_handle = ",".join(name for name in names if name and name not in taken)
        for signum in FORWARDED_SIGNALS:
            signal.signal(signum, self.handle)

    def _forward(self, signum: int, pids: Sequence[int]) -> None:
        for pid in pids:
            try:
                os.killpg(pid, signum)  # the rank's process group, as torch's agent signals it
            except (ProcessLookupError, PermissionError):
                pass

    def handle(self, signum: int, frame: FrameType | None) -> None:
        if self.forwarded_to:  # a second signal while waiting: the ranks decide what it means (status 4)
            self._forward(signum, self.forwarded_to)
            return
        if not pathlib.Path("/proc/self/stat").exists():  # the ranks cannot be found: torch's own path
            raise SignalException(f"stopped by {signal.Signals(signum).name}", sigval=signal.Signals(signum))
        ranks = child_processes(os.getpid())
        if not ranks:  # no rank started yet (rendezvous): nothing to wait for
            raise RanksStopped(signum, {})
        self.forwarded_to = ranks
        self._forward(signum, ranks)
        raise RanksStopped(signum, wait_without_reaping(ranks))


class HideAgentRecords(logging.Filter):
    """Drops torch.distributed's records below CRITICAL: in this process they are the agent's."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.CRITICAL or not record.name.startswith("torch.distributed")


def hide_agent_log() -> None:
    if os.environ.get("LOGLEVEL"):  # torchrun's own switch: the user wants its log
        return
    for name in ("", "torch", "torch.distributed"):
        for handler in logging.getLogger(name).handlers:
            handler.addFilter(HideAgentRecords())


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    hide_agent_log()
    SignalForwarder().install(args)
    try:
        run(args)
    except RanksStopped as stop:
        if not stop.codes:
            print(
                f"error: stopped by {stop.sigval.name} before the ranks started: nothing was trained",
                file=sys.stderr,
                flush=True,
            )
            return STOPPED_UNSAVED
        return max(exit_status(code) for code in stop.codes.values())
    except SignalException as stop:  # SIGHUP, SIGQUIT, or a platform without /proc
        print(f"error: stopped by {stop.sigval.name}; the ranks were stopped with it", file=sys.stderr, flush=True)
        return exit_status(-stop.sigval)
    except ChildFailedError as failed:
        rank, failure = reported_failure(failed)
        if failure.exitcode < 0:  # killed: the rank could not say why
            print(
                f"error: rank {rank} (pid {failure.pid}) was killed by {failure.signal_name()}; "
                f"the newest complete checkpoint is kept (resume with checkpoint.resume=auto)",
                file=sys.stderr,
                flush=True,
            )
        elif failure.exitcode not in (2, 3, 4, 5):  # not one of the job's endings (e.g. a traceback above)
            print(
                f"error: rank {rank} exited with status {failure.exitcode} (its output is above)",
                file=sys.stderr,
                flush=True,
            )
        return exit_status(failure.exitcode)
    except Exception as error:
        print(
            f"error: torchrun's agent failed: {type(error).__name__}: {' '.join(str(error).split())}; "
            f"rerun with LOGLEVEL=INFO for its log",
            file=sys.stderr,
            flush=True,
        )
        return LAUNCHER_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main())
