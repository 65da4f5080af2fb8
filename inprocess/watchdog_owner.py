"""The rank's side of its watchdog: it starts the watchdog process and beats to it.

The watchdog is a separate process that reports the rank's death and enforces hard_timeout;
the rank owns a ``Watchdog`` (that process plus a heartbeat thread). This module runs in the
rank process, so it lives outside ``inprocess/watchdog/``, which holds the watchdog process
(``python -m restartable.inprocess.watchdog``) and the pipe protocol both sides speak
(``inprocess.watchdog.pipe``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import subprocess
import sys
import threading
from pathlib import Path
from types import TracebackType
from typing import IO

from restartable.checkpoint.private_files import open_private, private_dir
from restartable.checkpoint.sealing import SECRET_ENV
from restartable.inprocess.clock import SYSTEM, Clock

# The pipe protocol lives beside the process side (stdlib only, cheap to import).
from restartable.inprocess.watchdog.pipe import CLOSE_MESSAGE, READY_MESSAGE, beat_line

log = logging.getLogger(__name__)

_CLOSE_WAIT_S = 5.0  # the process exits within milliseconds of "close"; kill it after this
_READY_TIMEOUT_S = 60.0  # a badly overloaded host; never block a rank's start for longer


class Watchdog:
    """Owner, in the rank, of its watchdog process and heartbeat thread.

    Call order: ``start()`` once when the wrapper starts, ``set_iteration(n)`` at the start of
    every restart iteration, ``close()`` when the rank leaves normally (idempotent; also on
    ``__exit__``). ``start()`` blocks until the process watches (no torch: tens of ms on a
    quiet host, bounded); ``close()`` waits at most a few seconds; the rest is a pipe write.

    How it works: a daemon thread writes the current iteration to the process's stdin every
    ``heartbeat_interval``. That thread needs the GIL, so the beats stop only when the process
    is frozen or its main thread holds the GIL in a C call. The process then sends SIGCONT and
    SIGTERM, waits ``termination_grace_time``, sends SIGKILL and reports ``kind="hard_timeout"``.
    When the rank process disappears (killed, OOM, segfault) the watchdog notices at once (pidfd
    and EOF on its stdin, no polling) and reports ``kind="dead"`` for the current iteration.
    After a report, or after ``close()``, the process exits.
    """

    def __init__(
        self,
        *,
        store_host: str,
        store_port: int,
        store_url: str | None = None,
        job_id: str | None = None,
        initial_rank: int,
        hard_timeout: float,
        termination_grace_time: float,
        heartbeat_interval: float,
        logdir: str | None,
        secret: bytes | None = None,
        clock: Clock = SYSTEM,
    ) -> None:
        """``secret``: the job's secret (``checkpoint.sealing``), handed to the watchdog process
        in its environment (private to this user), so its fault reports are sealed. ``clock``
        times the start-up (for the log). Raises ``ValueError`` naming a bad argument."""
        _check_arguments(
            store_port=store_port,
            store_url=store_url,
            hard_timeout=hard_timeout,
            termination_grace_time=termination_grace_time,
            heartbeat_interval=heartbeat_interval,
        )
        self._clock = clock
        self._store_host = store_host
        self._store_port = store_port
        self._store_url = store_url
        self._job_id = job_id
        self._initial_rank = initial_rank
        self._hard_timeout = hard_timeout
        self._grace = termination_grace_time
        self._interval = heartbeat_interval
        self._logdir = logdir
        self._secret = secret
        self._iteration = 0
        self._reserve = False
        self._lock = threading.Lock()  # one writer at a time on the pipe
        self._stop = threading.Event()
        self._proc: subprocess.Popen[bytes] | None = None
        self._thread: threading.Thread | None = None
        self._broken = False
        self._ready = False
        self._closed = False

    @property
    def pid(self) -> int | None:
        """The watchdog process's pid once started (for logs and tests)."""
        return None if self._proc is None else self._proc.pid

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        if self._secret is not None:
            env[SECRET_ENV] = self._secret.hex()
        return env

    def _open_log(self, cmd: list[str]) -> IO[bytes] | None:
        """The watchdog's log file, named on ``cmd`` too (appended, 0600, never through a link,
        in a private directory: the child keeps its own copy of the descriptor); None without
        ``monitor_process_logdir``."""
        if self._logdir is None:
            return None
        private_dir(self._logdir, what="monitor_process_logdir")  # no planted links in it
        path = Path(self._logdir) / f"watchdog_rank{self._initial_rank}.log"
        cmd.append(f"--logfile={path}")
        return os.fdopen(open_private(path, os.O_WRONLY | os.O_APPEND, exclusive=False), "ab")

    def start(self) -> None:
        """Start the watchdog process and the heartbeat thread; wait until the process watches.

        Waiting here (at most ``_READY_TIMEOUT_S``), before the caller's start-up barrier, means
        every rank is watched from the first iteration on: a death right after the start is
        reported in milliseconds, not once a late watchdog has imported torch (measured: a
        reserve whose watchdog was still starting held up the first restart by ~1 s).
        """
        if self._proc is not None or self._closed:
            raise RuntimeError("Watchdog.start() called twice or after close(): create a new one")
        cmd = self._command()
        stderr = self._open_log(cmd)
        try:
            # subprocess (fork+exec at once), never a bare fork of a process that loaded torch;
            # own session, so a signal to the rank's process group does not take it along.
            self._proc = subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                start_new_session=True,
                env=self._env(),
            )
        finally:
            if stderr is not None:
                stderr.close()
        assert self._proc.stdin is not None
        # A full pipe (watchdog stalled) must never block the rank: drop the beat instead.
        os.set_blocking(self._proc.stdin.fileno(), False)
        self._thread = threading.Thread(
            target=self._beat, name=f"inprocess-heartbeat-{self._initial_rank}", daemon=True
        )
        self._thread.start()
        t0 = self._clock.monotonic()
        if not self.wait_ready(_READY_TIMEOUT_S):
            log.warning(
                "watchdog of rank %d not ready after %.0f s: deaths are reported late",
                self._initial_rank,
                _READY_TIMEOUT_S,
            )
        log.debug(
            "watchdog pid %d of rank %d ready in %.3f s",
            self._proc.pid,
            self._initial_rank,
            self._clock.monotonic() - t0,
        )

    def _command(self) -> list[str]:
        """The watchdog process's command line (stdlib and this project only: no torch)."""
        cmd = [
            sys.executable,
            "-m",
            "restartable.inprocess.watchdog",
            f"--store-host={self._store_host}",
            f"--store-port={self._store_port}",
            f"--initial-rank={self._initial_rank}",
            f"--pid={os.getpid()}",
            f"--iteration={self._iteration}",
            *(["--reserve"] if self._reserve else []),
            f"--hard-timeout={self._hard_timeout}",
            f"--termination-grace-time={self._grace}",
        ]
        if self._store_url is not None:
            cmd.append(f"--store-url={self._store_url}")
            if self._job_id is not None:
                cmd.append(f"--job-id={self._job_id}")
        return cmd

    def wait_ready(self, timeout: float) -> bool:
        """Wait at most ``timeout`` s until the process is connected to the store and watching.

        The process reaches the store with a pure-Python client
        (``inprocess.protocol.tcpstore_client``); a death before it is ready is still reported,
        only that much later.
        """
        proc = self._proc
        if proc is None or proc.stdout is None:
            raise RuntimeError("Watchdog.wait_ready() before start()")
        if not self._ready:
            readable, _, _ = select.select([proc.stdout], [], [], timeout)
            self._ready = bool(readable) and proc.stdout.readline() == READY_MESSAGE
        return self._ready

    def set_iteration(self, iteration: int, *, reserve: bool = False) -> None:
        """Deaths from now on are reported for ``iteration``; tells the process at once.

        ``reserve``: this rank waits as a reserve in ``iteration``: its death only marks it
        gone (``fault_records.record_reserve_gone``) and never interrupts the ranks that train."""
        self._iteration = iteration
        self._reserve = reserve
        self._send(self._beat_line())

    def _beat_line(self) -> bytes:
        return beat_line(self._iteration, reserve=self._reserve)

    def close(self) -> None:
        """Stop the heartbeat and the process without reporting anything (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self._interval + 1.0)
        proc = self._proc
        if proc is None:
            return
        self._send(CLOSE_MESSAGE)
        with self._lock:
            if proc.stdin is not None:
                # OSError: the process is already gone, there is nothing left to tell it.
                with contextlib.suppress(OSError):
                    proc.stdin.close()
        try:
            proc.wait(_CLOSE_WAIT_S)
        except subprocess.TimeoutExpired:
            log.warning("watchdog pid %d did not exit after close; killing it", proc.pid)
            proc.kill()
            proc.wait(_CLOSE_WAIT_S)
        if proc.stdout is not None:
            proc.stdout.close()

    def __enter__(self) -> Watchdog:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _beat(self) -> None:
        self._send(self._beat_line())
        while not self._stop.wait(self._interval):
            self._send(self._beat_line())

    def _send(self, data: bytes) -> None:
        proc = self._proc
        if proc is None or proc.stdin is None or self._broken:
            return
        with self._lock:
            try:
                os.write(proc.stdin.fileno(), data)
            except BlockingIOError:
                pass  # the pipe is full: the process has beats enough to read
            except (BrokenPipeError, ValueError, OSError):
                self._broken = True
                if not self._closed:
                    log.warning(
                        "watchdog process of rank %d is gone (exit %s): this rank's death or "
                        "hang will not be reported",
                        self._initial_rank,
                        proc.poll(),
                    )


def _check_arguments(
    *,
    store_port: int,
    store_url: str | None,
    hard_timeout: float,
    termination_grace_time: float,
    heartbeat_interval: float,
) -> None:
    """``Watchdog``'s arguments, checked before anything starts (``ValueError`` names one)."""
    for name, value in (
        ("hard_timeout", hard_timeout),
        ("heartbeat_interval", heartbeat_interval),
    ):
        if not 0 < value < float("inf"):  # inf: a hung rank would never be killed
            raise ValueError(
                f"{name} ({value}) must be > 0 seconds and finite: give a positive duration"
            )
    if not 0 <= termination_grace_time < float("inf"):
        raise ValueError(
            f"termination_grace_time ({termination_grace_time}) must be >= 0 seconds and "
            "finite: give the time a rank gets between SIGTERM and SIGKILL"
        )
    if heartbeat_interval >= hard_timeout:
        raise ValueError(
            f"heartbeat_interval ({heartbeat_interval}) must be smaller than hard_timeout "
            f"({hard_timeout}), or a healthy rank is killed between two beats: lower "
            "heartbeat_interval"
        )
    # With the etcd store (store_url) the process connects there and the port is unused.
    if store_url is None and not 0 < store_port < 65536:
        raise ValueError(f"store_port ({store_port}) must be a TCP port (1..65535)")
