"""How a rank ends with its one line: the line on stderr (once per job), in torchrun's error
file, and, for an error every rank meets alike, rank 0 ending first.

torchrun's agent gives every rank a `TORCHELASTIC_ERROR_FILE` path; when a rank exits non-zero
it reads that JSON file and shows its `message` in the failure summary it prints (in place of
"error_file: <N/A> ... To enable traceback see: ..."). The job's endings are one line, so that
line is the message. The agent also SIGTERMs the other ranks as soon as one ends: if a rank
other than 0 ended first with an error every rank meets (a recipe, data or layout error, which
only rank 0 prints), rank 0 could be stopped before it printed the line. So under torchrun those
ranks wait for the agent's SIGTERM (sent when rank 0 has ended), then exit with their status.
Stdlib only: the config-error path runs before torch is imported.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Mapping
from typing import NoReturn

__all__ = ["exit_same_on_every_rank", "write_torchrun_error_file"]

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
RANK_ZERO_FIRST_S = 10.0
"""How long a rank other than 0 waits for rank 0 to end first (it ends within milliseconds)."""


def write_torchrun_error_file(line: str, environ: Mapping[str, str] | None = None) -> None:
    """Record `line` as this rank's failure message for torchrun (a no-op outside torchrun; a
    file that cannot be written only loses torchrun's copy of the line, never the exit)."""
    path = (os.environ if environ is None else environ).get(ERROR_FILE_ENV)
    if not path:
        return
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w", encoding="utf-8") as stream:
            json.dump({"message": line, "timestamp": int(time.time())}, stream)
    except OSError:
        pass


def exit_same_on_every_rank(line: str, status: int) -> NoReturn:
    """End with `status` after an error every rank meets alike: rank 0 prints `line` and exits;
    under torchrun the other ranks exit when the agent stops them (rank 0 has ended), at the
    latest after RANK_ZERO_FIRST_S."""
    write_torchrun_error_file(line)
    if int(os.environ.get("RANK", "0")) == 0:
        print(line, file=sys.stderr, flush=True)
    elif "TORCHELASTIC_RUN_ID" in os.environ:
        sys.stdout.flush()
        signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(status))
        time.sleep(RANK_ZERO_FIRST_S)
    raise SystemExit(status)
