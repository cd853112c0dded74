"""`GracefulExit`: turn SIGTERM/SIGINT/SIGHUP into a stop flag the training loop checks (and agrees on
across ranks), so a job saves a checkpoint before it exits; and a watchdog that ends the process
when the loop cannot answer (a rank blocked in a collective whose peer stopped answering).

Python runs a signal handler only when the main thread returns to the interpreter: a rank blocked
inside a gloo/NCCL collective would ignore SIGTERM until the collective's timeout. So the C-level
handler's wakeup byte (`signal.set_wakeup_fd`) also reaches a watchdog thread, which gives the
loop `grace_s` to notice the request (`requested()` returning True acknowledges it) and otherwise
calls `on_unanswered` (by default: one line on stderr and `os._exit(STOPPED_UNSAVED)`). A second
signal more than a second after the first means "now": the watchdog calls `on_unanswered` too.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

from k3train.job.ending import write_torchrun_error_file

# torch is imported where the stop flag is agreed (`GracefulExit.requested`), not here: the job
# installs `stop_signals_raise` before torch loads, so a Ctrl-C during the imports is one line too.


STOPPED = 3
"""Exit status of a run stopped by SIGTERM/SIGINT after saving a checkpoint at the step it printed."""
STOPPED_UNSAVED = 4
"""Exit status of a run stopped by a signal it could not honour in time (blocked, or signalled twice): no save."""

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""What asks the job to stop. SIGHUP too: a closed terminal sends it, and torchrun's agent,
which handles SIGHUP like SIGTERM, forwards it to every rank (its default is a silent death)."""

TORCHRUN_STOP_WINDOW_S = 30.0
"""torchrun's agent, stopped by a signal, forwards it to the ranks and SIGKILLs those still
running `TORCH_ELASTIC_SHUTDOWN_TIMEOUT` seconds later, 30 by default
(torch/distributed/elastic/multiprocessing/api.py, `PContext.close(death_sig, timeout=30)`;
`--shutdown-timeout` sets the agent's value without telling the ranks)."""
SAVE_MARGIN_S = 10.0
"""Of torchrun's window, what the grace leaves for the save after the step (at least half)."""


def launcher_grace(grace_s: float, environ: Mapping[str, str]) -> tuple[float, str | None]:
    """The stop grace to use: `grace_s`, or under torchrun at most its window less the time the
    save needs (so the stop saves, or says why not, before the SIGKILL), with the line saying so."""
    if "TORCHELASTIC_RUN_ID" not in environ:
        return grace_s, None
    raw = environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "")
    try:
        window = float(raw) if raw else TORCHRUN_STOP_WINDOW_S
    except ValueError:
        window = TORCHRUN_STOP_WINDOW_S
    limit = max(window - SAVE_MARGIN_S, window / 2)
    if grace_s <= limit:
        return grace_s, None
    return limit, (
        f"train.stop_grace_s={grace_s:g} is longer than torchrun allows after a stop signal "
        f"({window:g}s to SIGKILL, TORCH_ELASTIC_SHUTDOWN_TIMEOUT): the step in progress gets {limit:g}s "
        f"and the save the rest; set TORCH_ELASTIC_SHUTDOWN_TIMEOUT (for torchrun and the ranks) to give more"
    )


# A repeated signal closer than this to the first is the same request (a launcher forwarding the
# signal its process group already got), not an impatient second one.
_REPEAT_WINDOW_S = 1.0


def signal_name(signum: int | None) -> str:
    try:
        return signal.Signals(signum).name if signum is not None else "signal"
    except ValueError:
        return f"signal {signum}"


def exit_unsaved(signum: int, reason: str, step: int | None = None, print_line: bool = True) -> None:
    """One line on stderr (unless `print_line` is False: another rank prints it) and
    `os._exit(STOPPED_UNSAVED)` (the main thread may be blocked for good)."""
    where = (
        f"stopped at step {step} ({signal_name(signum)})" if step is not None else f"stopped by {signal_name(signum)}"
    )
    line = (
        f"error: {where} without saving a checkpoint: {reason}; "
        f"the newest complete checkpoint is kept (resume with checkpoint.resume=auto)"
    )
    if print_line:
        print(line, file=sys.stderr, flush=True)
    write_torchrun_error_file(line)
    sys.stdout.flush()
    os._exit(STOPPED_UNSAVED)


class StoppedOutsideTheLoop(BaseException):
    """SIGTERM/SIGINT while no `GracefulExit` is active (start-up: imports, the model build, a
    resume): nothing is trained yet that a save could keep, so the process ends at once with
    status 4 and one line. A BaseException, as KeyboardInterrupt is: `except Exception` blocks
    on the way up must not swallow it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal_name(signum))
        self.signum = signum


def stop_signals_raise() -> None:
    """Make SIGTERM and SIGINT raise `StoppedOutsideTheLoop` in the main thread (torch's default
    for SIGTERM is to die silently with -15 and SIGINT a KeyboardInterrupt traceback).
    `GracefulExit` replaces these handlers while the loop runs and puts them back after it."""

    def handle(signum: int, frame: Any) -> None:
        raise StoppedOutsideTheLoop(signum)

    for signum in STOP_SIGNALS:
        signal.signal(signum, handle)


def _say_at_once(line: str) -> None:
    """`line` on this process's stdout from a signal handler: os.write, because print() there can
    re-enter stdout's buffer the main thread is writing. A rank whose stdout is silenced (the job
    prints from rank 0) writes to its os.devnull."""
    try:
        os.write(sys.stdout.fileno(), line.encode())
    except (AttributeError, OSError, ValueError):  # a stdout without a file (a test's capture)
        pass


class GracefulExit:
    """While active, SIGTERM and SIGINT set `should_stop` instead of ending the process, so the
    training loop can save a checkpoint and return. A second SIGINT raises KeyboardInterrupt (two
    Ctrl-C still stop a stuck job). Previous handlers are restored on exit.

        with GracefulExit(grace_s=60) as stop:
            for step in ...:
                ...
                if stop.requested(process_group):   # any rank signalled -> every rank stops
                    checkpointer.save(step, app_state); break

    If the loop does not see the request within `grace_s` (the main thread is blocked, so even the
    Python handler has not run), or a second signal arrives, the watchdog thread calls
    `on_unanswered(signum, reason)`, which must end the process.

    Signal handlers can only be installed from the main thread; elsewhere this warns and the flag
    stays False.
    """

    def __init__(
        self,
        signals: Iterable[int] = STOP_SIGNALS,
        grace_s: float = 60.0,
        on_unanswered: Callable[[int, str], None] = exit_unsaved,
    ) -> None:
        self.signals = tuple(signals)
        self.grace_s = grace_s
        self.on_unanswered = on_unanswered
        self.should_stop = False
        self.received: int | None = None
        self.acknowledged = False
        self._previous: dict[int, Any] = {}
        self._previous_wakeup_fd: int | None = None
        self._wakeup: tuple[socket.socket, socket.socket] | None = None
        self._watchdog: threading.Thread | None = None
        self._closing = threading.Event()

    def _handle(self, signum: int, frame: Any) -> None:
        if self.should_stop and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.should_stop = True
        self.received = signum
        _say_at_once(f"received {signal_name(signum)}: finishing the step, saving a checkpoint and exiting\n")

    # ------------------------------------------------------------------ the watchdog
    def _watch(self, reader: socket.socket) -> None:
        """Wait for wakeup bytes; after the first of our signals, give the loop `grace_s` to
        acknowledge, and end the process if it does not (or if a second signal comes)."""
        first: tuple[int, float] | None = None
        while not self._closing.is_set():
            if first is None or self.acknowledged:
                timeout = None
            else:
                timeout = max(0.0, first[1] + self.grace_s - time.monotonic())
            reader.settimeout(timeout)
            try:
                data = reader.recv(64)
            except TimeoutError:
                data = None
            except OSError:
                return
            if self._closing.is_set() or data == b"":
                return
            now = time.monotonic()
            for signum in data or b"":
                if signum not in self.signals:
                    continue
                if first is None:
                    first = (signum, now)
                elif now - first[1] > _REPEAT_WINDOW_S:
                    time.sleep(_REPEAT_WINDOW_S)  # a second SIGINT first raises KeyboardInterrupt
                    if not self._closing.is_set():
                        self.on_unanswered(signum, f"{signal_name(signum)} received twice")
                    return
            if first is not None and not self.acknowledged and time.monotonic() >= first[1] + self.grace_s:
                if not self._closing.is_set():
                    self.on_unanswered(
                        first[0],
                        f"the step in progress did not finish within {self.grace_s:g}s "
                        f"(a rank blocked on a collective?)",
                    )
                return

    def _start_watchdog(self) -> None:
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        try:
            self._previous_wakeup_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        except ValueError:  # not the main thread
            reader.close()
            writer.close()
            return
        self._wakeup = (reader, writer)
        self._watchdog = threading.Thread(target=self._watch, args=(reader,), name="k3train-stop-watchdog", daemon=True)
        self._watchdog.start()

    def _stop_watchdog(self) -> None:
        if self._wakeup is None:
            return
        self._closing.set()
        signal.set_wakeup_fd(self._previous_wakeup_fd if self._previous_wakeup_fd is not None else -1)
        reader, writer = self._wakeup
        writer.close()
        if self._watchdog is not None:
            self._watchdog.join(timeout=5)
        reader.close()
        self._wakeup, self._watchdog = None, None

    # ------------------------------------------------------------------ context
    def __enter__(self) -> GracefulExit:
        if threading.current_thread() is not threading.main_thread():
            warnings.warn("GracefulExit: not the main thread, signal handlers not installed", stacklevel=2)
            return self
        for sig in self.signals:
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._handle)
        self._start_watchdog()
        return self

    def __exit__(self, *exc: Any) -> Literal[False]:
        self._stop_watchdog()
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
        return False

    def requested(self, process_group: Any = None) -> bool:
        """`should_stop` agreed over the process group (True if any rank got a signal). True
        acknowledges the request: the watchdog then leaves the save to the loop."""
        import torch
        import torch.distributed as dist

        from k3train.checkpoint.process_group import distributed_active

        if not distributed_active():
            stop = self.should_stop
        else:
            flag = torch.tensor([1 if self.should_stop else 0], dtype=torch.int32)
            if dist.get_backend(process_group) == "nccl":
                flag = flag.cuda()
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=process_group)
            stop = bool(flag.item())
        if stop:
            self.acknowledged = True
        return stop
