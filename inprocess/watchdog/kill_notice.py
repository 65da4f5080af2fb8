"""The notice a rank's watchdog leaves before its hard-timeout SIGTERM.

The watchdog ends a rank that missed its heartbeat with SIGTERM, ``termination_grace_time``,
then SIGKILL. A rank whose blocking call returns on a signal (a sleep or a read: EINTR) runs
its Python SIGTERM handler, and a ``PreemptionHandler`` would take the kill for the scheduler's
preemption notice and stop the whole job (found by the fault matrix: a GIL-held hang ended the
job with status 75 instead of a reserve taking the rank's place). So the watchdog posts this
notice first, and the handler does not count a SIGTERM while its process has one.

A file, not a signal payload: Python's handlers do not see the sender. Named by the rank's pid
in the temporary directory that both processes share (the watchdog inherits the environment).
"""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path


def _path(pid: int) -> Path:
    return Path(tempfile.gettempdir()) / f"inprocess-hard-timeout-{pid}"


def post(pid: int) -> None:
    """Watchdog: the SIGTERM that follows is a hard-timeout kill of ``pid``. Best effort."""
    with contextlib.suppress(OSError):
        _path(pid).write_bytes(b"")


def posted(pid: int) -> bool:
    """Rank (in its signal handler): whether a hard-timeout kill of ``pid`` is under way."""
    return _path(pid).exists()


def clear(pid: int) -> None:
    """Watchdog: the kill is over (the process is gone, or the notice is stale)."""
    with contextlib.suppress(OSError):
        _path(pid).unlink()
