"""One job per run directory: an advisory lock that rank 0 holds from start-up to exit.

Two jobs on one directory would each clean the other's unfinished checkpoint saves, resume from
the other's steps and overwrite its `config.yaml`. So rank 0 takes `.k3train.lock` in the run
directory (and in `checkpoint.dir` when that lies elsewhere) before anything there is read,
cleaned or written, and a second job is refused with one line naming the holder.

The lock is `flock` on the file (the kernel drops it when the process dies, however it dies:
`os._exit`, kill -9) plus the holder's pid, host and start time written in it. A lock file whose
flock is free but whose pid is alive on this host is still refused (a filesystem that ignores
flock); one whose pid is dead on this host is stale and taken over with a notice; one written on
another host cannot be checked from here and is refused, naming the file to delete. The file is
removed on a normal exit (atexit) and left behind, stale, by a crash. Stdlib only.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from k3train.errors import RunDirectoryError

__all__ = ["LOCK_NAME", "RunDirectoryLock", "lock_run_directories", "release_run_directories"]

LOCK_NAME = ".k3train.lock"
_held: list[RunDirectoryLock] = []
"""The locks this process holds (`release_run_directories` drops them all)."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _describe(holder: dict) -> str:
    started = holder.get("started")
    when = (
        time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, int | float) else ""
    )
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}{when}"


def _read_holder(fd: int) -> dict | None:
    """The holder recorded in the lock file (None when it is empty or not ours)."""
    os.lseek(fd, 0, os.SEEK_SET)
    raw = os.read(fd, 4096)
    try:
        holder = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


class RunDirectoryLock:
    """The lock on one directory; `acquire` raises `RunDirectoryError` naming a live holder."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.path = self.directory / LOCK_NAME
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> str | None:
        """Take the lock; returns a notice when a stale lock was taken over, else None."""
        refuse_tail = (
            "; wait for that job to end, stop it, or pass another --run-dir "
            f"(if it has ended on that host, delete {self.path})"
        )
        for _ in range(10):  # the file can be removed between our open and our flock
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as error:
                raise RunDirectoryError(
                    f"locking {self.directory} failed: cannot open {self.path} ({error.strerror or error}); "
                    "pass a writable --run-dir"
                ) from error
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                live = _read_holder(fd) or {}
                os.close(fd)
                raise RunDirectoryError(
                    f"run directory {self.directory} is in use by another job ({_describe(live)}){refuse_tail}"
                ) from None
            except OSError:  # a filesystem without flock: the pid and host below still decide
                pass
            try:
                same_file = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same_file = False
            if not same_file:  # its holder removed it while we waited: take the new one
                os.close(fd)
                continue
            break
        else:
            raise RunDirectoryError(f"locking {self.directory} failed: {self.path} keeps changing{refuse_tail}")
        notice = None
        holder = _read_holder(fd)
        here = socket.gethostname()
        if holder and holder.get("pid") != os.getpid():
            pid, host = holder.get("pid"), holder.get("host")
            if host != here:
                os.close(fd)
                raise RunDirectoryError(
                    f"run directory {self.directory} is locked by a job on another host ({_describe(holder)}); "
                    f"its liveness cannot be checked from {here}{refuse_tail}"
                )
            if isinstance(pid, int) and _pid_alive(pid):
                os.close(fd)
                raise RunDirectoryError(
                    f"run directory {self.directory} is in use by another job ({_describe(holder)}){refuse_tail}"
                )
            notice = f"taking over the stale lock {self.path} of {_describe(holder)} (that process has ended)"
        record = json.dumps({"pid": os.getpid(), "host": here, "started": time.time()}).encode()
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, record)
        os.fsync(fd)
        self._fd = fd
        _held.append(self)
        atexit.register(self.release)
        return notice

    def release(self) -> None:
        """Remove the lock file and drop the lock (idempotent). Removing it before closing means
        a job that opens the old file afterwards sees it replaced and retries."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        if self in _held:
            _held.remove(self)
        with contextlib.suppress(OSError):
            if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                os.unlink(self.path)
        with contextlib.suppress(OSError):
            os.close(fd)


def lock_run_directories(directories: list[Path]) -> list[RunDirectoryLock]:
    """Create and lock each directory (the same one named twice is locked once); on a refusal the
    locks already taken are released and the `RunDirectoryError` raised."""
    locks: list[RunDirectoryLock] = []
    seen: set[Path] = set()
    try:
        for directory in directories:
            try:
                directory.mkdir(parents=True, exist_ok=True)
                key = directory.resolve()
            except OSError as error:
                raise RunDirectoryError(
                    f"creating {directory} failed ({error.strerror or error}); pass a writable --run-dir"
                ) from error
            if key in seen:
                continue
            seen.add(key)
            lock = RunDirectoryLock(directory)
            notice = lock.acquire()
            locks.append(lock)
            if notice:
                print(f"warning: {notice}", file=sys.stderr, flush=True)
    except RunDirectoryError:
        for lock in locks:
            lock.release()
        raise
    return locks


def release_run_directories() -> None:
    """Drop every lock this process holds (the job's way out, whatever it is)."""
    for lock in list(_held):
        lock.release()
