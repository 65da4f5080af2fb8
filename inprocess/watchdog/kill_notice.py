"""The notice a rank's watchdog leaves before its hard-timeout SIGTERM.

The watchdog ends a rank that missed its heartbeat with SIGTERM, ``termination_grace_time``,
then SIGKILL. A rank whose blocking call returns on a signal (a sleep or a read: EINTR) runs
its Python SIGTERM handler, and a ``PreemptionHandler`` would take the kill for the scheduler's
preemption notice and stop the whole job (found by the fault matrix: a GIL-held hang ended the
job with status 75 instead of a reserve taking the rank's place). So the watchdog posts this
notice first, and the handler does not count a SIGTERM while its process has one.

A file, not a signal payload: Python's handlers do not see the sender. Named by the rank's pid
in a directory private to this user (``$XDG_RUNTIME_DIR`` or the temporary directory, then
``restartable-<uid>``, mode 0700; both processes find it, the watchdog inherits the
environment): in a shared /tmp another user could create the notice and make a real SIGTERM be
ignored. A directory of that name that another user owns is refused: no notice is posted then
(a hard-timeout kill may stop the job as a preemption would, never the other way round).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from restartable.checkpoint.private_files import private_dir


def _path(pid: int) -> Path:
    """The notice of ``pid``; raises OSError when the private directory is not ours."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    notices = private_dir(Path(base) / f"restartable-{os.getuid()}", what="kill notice directory")
    return notices / f"hard-timeout-{pid}"


def post(pid: int) -> None:
    """Watchdog: the SIGTERM that follows is a hard-timeout kill of ``pid``. Best effort."""
    with contextlib.suppress(OSError):
        os.close(os.open(_path(pid), os.O_WRONLY | os.O_CREAT, 0o600))


def posted(pid: int) -> bool:
    """Rank (in its signal handler): whether a hard-timeout kill of ``pid`` is under way."""
    try:
        return _path(pid).exists()
    except OSError:  # the directory is someone else's: no notice can be ours
        return False


def clear(pid: int) -> None:
    """Watchdog: the kill is over (the process is gone, or the notice is stale)."""
    with contextlib.suppress(OSError):
        _path(pid).unlink()
