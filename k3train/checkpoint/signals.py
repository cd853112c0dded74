"""`GracefulExit`: turn SIGTERM/SIGINT into a stop flag the training loop checks (and agrees on
across ranks), so a job saves a checkpoint before it exits."""

from __future__ import annotations

import logging
import signal
import threading
import warnings
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist

from k3train.checkpoint.process_group import distributed_active

logger = logging.getLogger(__name__)


class GracefulExit:
    """While active, SIGTERM and SIGINT set `should_stop` instead of ending the process, so the
    training loop can save a checkpoint and return. A second SIGINT raises KeyboardInterrupt (two
    Ctrl-C still stop a stuck job). Previous handlers are restored on exit.

        with GracefulExit() as stop:
            for step in ...:
                ...
                if stop.requested(process_group):   # any rank signalled -> every rank stops
                    checkpointer.save(step, app_state); break

    Signal handlers can only be installed from the main thread; elsewhere this warns and the flag
    stays False.
    """

    def __init__(self, signals: Iterable[int] = (signal.SIGTERM, signal.SIGINT)) -> None:
        self.signals = tuple(signals)
        self.should_stop = False
        self.received: Optional[int] = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.should_stop and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.should_stop = True
        self.received = signum
        logger.warning(
            "received %s: finishing the step, saving a checkpoint and exiting",
            signal.Signals(signum).name,
        )

    def __enter__(self) -> "GracefulExit":
        if threading.current_thread() is not threading.main_thread():
            warnings.warn("GracefulExit: not the main thread, signal handlers not installed", stacklevel=2)
            return self
        for sig in self.signals:
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> bool:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
        return False

    def requested(self, process_group: Any = None) -> bool:
        """`should_stop` agreed over the process group (True if any rank got a signal)."""
        if not distributed_active():
            return self.should_stop
        flag = torch.tensor([1 if self.should_stop else 0], dtype=torch.int32)
        if dist.get_backend(process_group) == "nccl":
            flag = flag.cuda()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=process_group)
        return bool(flag.item())
