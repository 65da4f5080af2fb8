"""The launcher's warm process pool: one pre-started fork server per node
(``inprocess.forkserver``) from which respawned and restarted ranks are forked, with
torch and the named modules already imported; the cold start stays the fallback.

Owned by ``inprocess.launch.cli`` (one ``WarmPool`` per launcher, over every round; ``close()``
it). ``start()`` returns at once: the server imports in the background, and until it says ready
(or after it broke) ``spawn`` returns None and the caller starts the rank cold. Nothing here
blocks longer than one short request.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

from restartable.inprocess.clock import SYSTEM, Clock
from restartable.inprocess.forkserver.wire import MAX_REQUEST, READY_LINE

log = logging.getLogger(__name__)

# What the pool imports by default: the interpreter's heaviest part of a rank's start.
DEFAULT_PRELOAD = ("torch", "torch.distributed", "restartable.inprocess.restart.loop")
_ANSWER_TIMEOUT_S = 5.0  # a fork is milliseconds; a server that does not answer is broken


class PooledProcess:
    """A rank forked by the pool: the part of ``subprocess.Popen`` the supervisor uses (``pid``,
    ``stdout``, ``poll``, ``wait``, ``kill``). The exit status comes from the server, which is
    the process's parent; killed with the server, it reads as SIGKILL."""

    def __init__(self, pid: int, conn: socket.socket, stdout: IO[bytes]) -> None:
        self.pid = pid
        self.stdout: IO[bytes] | None = stdout
        self.returncode: int | None = None
        self._conn = conn

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._conn], [], [], 0)[0]:
            self._read_exit()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._conn], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            self._read_exit()
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)

    def _read_exit(self) -> None:
        try:
            msg = self._conn.recv(64).decode()
        except OSError:
            msg = ""
        # No answer: the server died (and this process with it, PR_SET_PDEATHSIG).
        self.returncode = int(msg.split()[1]) if msg.startswith("exit ") else -signal.SIGKILL
        self._conn.close()


class WarmPool:
    """One node's fork server (a context manager; ``close()`` is idempotent).

    ``env``: the server's environment (the ranks' common one: OMP_NUM_THREADS and the like are
    read once by libraries at import); ``preload``: modules to import before any fork.
    """

    def __init__(self, *, env: Mapping[str, str], preload: Sequence[str]) -> None:
        self._env = dict(env)
        self._preload = tuple(preload)
        self._dir = Path(tempfile.mkdtemp(prefix="inprocess-pool-"))  # 0700: ours only
        self._socket = str(self._dir / "s")
        self._proc: subprocess.Popen[bytes] | None = None
        self._ready = False
        self._broken: str | None = None

    def __enter__(self) -> WarmPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def pid(self) -> int | None:
        """The server's pid once started."""
        return None if self._proc is None else self._proc.pid

    @property
    def broken(self) -> str | None:
        """Why the pool stopped serving, or None."""
        return self._broken

    def start(self) -> None:
        """Start the server (returns at once; it imports in the background)."""
        self._proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "restartable.inprocess.forkserver",
                f"--socket={self._socket}",
                f"--launcher-pid={os.getpid()}",
                f"--preload={','.join(self._preload)}",
            ],
            env={**self._env, "PYTHONUNBUFFERED": "1"},
            stdout=subprocess.PIPE,
            start_new_session=True,
        )

    def ready(self) -> bool:
        """True once the server listens and has imported what a rank's first DDP imports
        (``inprocess.forkserver``; never blocks: until then the caller starts ranks cold)."""
        proc = self._proc
        if self._broken is not None or proc is None or proc.stdout is None:
            return False
        if proc.poll() is not None:
            self._break(f"the server exited with status {proc.returncode}")
            return False
        if not self._ready and select.select([proc.stdout], [], [], 0)[0]:
            self._ready = proc.stdout.readline() == READY_LINE
            if not self._ready:
                self._break("the server did not say ready")
        return self._ready

    def warming(self) -> bool:
        """True while the server is started and alive but not ready yet (it imports): a fork
        asked for now is worth waiting for, briefly (never blocks)."""
        return self._proc is not None and not self.ready() and self._broken is None

    def spawn(
        self, argv: Sequence[str], *, env: Mapping[str, str], cwd: str | None = None
    ) -> PooledProcess | None:
        """Fork ``python argv...`` from the server with ``env``; None when the pool is not ready
        or broke (the caller starts the process cold). Its output goes to the returned
        object's ``stdout`` pipe, stdout and stderr together."""
        if not self.ready():
            return None
        assert self._proc is not None
        env = {**env, "INPROCESS_LAUNCHER_PID": str(self._proc.pid)}  # its parent: the server
        request = json.dumps({"argv": list(argv), "env": env, "cwd": cwd or os.getcwd()})
        if len(request) > MAX_REQUEST:
            self._break(f"a request of {len(request)} bytes is over {MAX_REQUEST}")
            return None
        read_end, write_end = os.pipe()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            conn.settimeout(_ANSWER_TIMEOUT_S)
            conn.connect(self._socket)
            socket.send_fds(conn, [request.encode()], [write_end])
            answer = conn.recv(64).decode()
            if not answer.startswith("pid "):
                raise OSError(f"unexpected answer {answer!r}")
            conn.settimeout(None)
        except OSError as exc:
            conn.close()
            os.close(read_end)
            self._break(f"a request failed: {exc!r}")
            return None
        finally:
            os.close(write_end)
        return PooledProcess(int(answer.split()[1]), conn, os.fdopen(read_end, "rb"))

    def close(self) -> None:
        """Stop the server (the ranks it forked were stopped by their supervisor first)."""
        proc, self._proc = self._proc, None
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _break(self, why: str) -> None:
        if self._broken is None:
            self._broken = why
            log.warning("warm pool off (cold starts from now on): %s", why)


def wait_ready(pool: WarmPool, timeout: float, *, clock: Clock = SYSTEM) -> bool:
    """Poll ``pool.ready()`` for at most ``timeout`` seconds (tests and benchmarks)."""
    end = clock.monotonic() + timeout
    while not pool.ready():
        if clock.monotonic() >= end or pool.broken is not None:
            return False
        clock.sleep(0.01)
    return True
