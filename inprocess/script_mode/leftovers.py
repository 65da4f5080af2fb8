"""What one run of an unmodified script leaves behind for the next one, warned once per kind.

A restart re-runs the script in the same process: the threads and processes it started, the
files it left open and the ``atexit`` handlers it registered outlive its run (docs/script_mode.md
says what is kept). ``Leftovers`` looks around each run (main thread): what a run started that
is still alive when the next run begins (its frames are gone by then, so a ``DataLoader``'s
workers that end with it are not counted), and handlers registered by a run after the first
(the first run's imports register their own).
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from restartable.inprocess import _cpython_private

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Snapshot:
    """What runs and is open in this process at one moment."""

    threads: dict[int, str]  # ident -> name
    children: frozenset[int]
    files: dict[int, str]  # fd -> path, regular files only
    atexit: int

    @classmethod
    def now(cls) -> Snapshot:
        threads = {t.ident: t.name for t in threading.enumerate() if t.ident is not None}
        return cls(threads, _children(), _regular_files(), _cpython_private.atexit_count())


@dataclass
class Leftovers:
    """``before_run()`` / ``after_run()`` around each run of the script; ``warn(key, line)``
    logs each key once (the runner's ``WarnOnce``)."""

    warn: Callable[[str, str], None]
    _start: Snapshot | None = None
    _started: Snapshot | None = None  # what the last run started and still had at its end
    _runs: int = 0

    def before_run(self) -> None:
        """Warn about what the previous run left running; then note what runs now."""
        now = Snapshot.now()
        if self._started is not None:
            self._judge(self._started, now)
        self._start, self._started = now, None

    def after_run(self) -> None:
        """Note what this run started and still has at its end (judged at the next run)."""
        if self._start is None:
            return
        end, start = Snapshot.now(), self._start
        self._runs += 1
        # The first run's imports register handlers of their own (torch's, once per process).
        handlers = end.atexit - start.atexit if self._runs > 1 else 0
        self._started = Snapshot(
            threads={i: n for i, n in end.threads.items() if i not in start.threads},
            children=end.children - start.children,
            files={fd: p for fd, p in end.files.items() if start.files.get(fd) != p},
            atexit=handlers,
        )

    def _judge(self, started: Snapshot, now: Snapshot) -> None:
        threads = sorted(n for i, n in started.threads.items() if i in now.threads)
        if threads:
            self.warn(
                "threads",
                f"{len(threads)} thread(s) the script started in the previous run still run in "
                f"this one ({', '.join(threads[:5])}): a restart does not stop them; stop and "
                "join them before the script ends (and in a finally: a fault unwinds it)",
            )
        children = sorted(started.children & now.children)
        if children:
            self.warn(
                "processes",
                f"{len(children)} process(es) the script started in the previous run still run "
                f"(pids {', '.join(map(str, children[:5]))}): a restart does not stop them; "
                "end them before the script ends (and in a finally: a fault unwinds it)",
            )
        files = sorted({p for fd, p in started.files.items() if now.files.get(fd) == p})
        if files:
            self.warn(
                "files",
                f"{len(files)} file(s) the script opened in the previous run are still open "
                f"({', '.join(files[:3])}): each run opens them again; use `with open(...)`",
            )
        if started.atexit > 0:
            self.warn(
                "atexit",
                f"the script registered {started.atexit} atexit handler(s) in the previous run: "
                "each run registers them again, and every copy runs at exit; register them "
                "once (guard with a module of your own) or clean up at the script's end",
            )


def _children() -> frozenset[int]:
    """This process's child pids (Linux ``/proc``; empty where it cannot be read)."""
    pids: set[int] = set()
    try:
        for task in Path("/proc/self/task").iterdir():
            text = (task / "children").read_text()
            pids.update(int(p) for p in text.split())
    except OSError:
        return frozenset()
    return frozenset(pids)


def _regular_files() -> dict[int, str]:
    """This process's open regular files by descriptor (Linux ``/proc``; empty elsewhere)."""
    files: dict[int, str] = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return files
    for name in fds:
        try:
            fd = int(name)
            if stat.S_ISREG(os.fstat(fd).st_mode):
                files[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except (OSError, ValueError):
            continue  # closed meanwhile (listdir's own descriptor among them)
    return files
