"""Warm starts for ``tests.multiproc.run_ranks``: each rank is forked from a process that has
already imported torch (``tests._zygote_main``) instead of a fresh interpreter importing it again.

Why: importing torch is most of a rank's start (about 1.8 s of one core, several seconds at load
6 on the 2-core host) and the default suite starts a few hundred ranks; what a test checks starts
after it. What stays as in a fresh ``python -m tests._rank_main``: the rank's own session, its
log, environment, working directory, umask and argv, every framework and test module imported in
the rank, the interpreter's normal exit, the exit status (negative: the signal). The framework's
own warm pool (``inprocess.launch.pool``) forks respawned ranks the same way.

Rank i of every call is forked from server i, one server per rank index: each server's
interpreter has its own string-hash seed, so the ranks of one job still iterate sets and dicts
of strings in different orders, as separate processes do (a rank that relies on the order of its
peers is not hidden).

A call falls back to cold starts (the fresh interpreter of before) when the ranks' environment
differs from the servers' in a variable that libraries read at import (``IMPORT_TIME_PREFIXES``:
torch's, OpenMP's, Python's own, the locale, the temporary directory), or with
``RESTARTABLE_COLD_RANKS=1`` in the test process's environment.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

IMPORT_TIME_PREFIXES = (
    "TORCH",
    "PYTORCH",
    "OMP_",
    "GOMP_",
    "KMP_",
    "MKL_",
    "OPENBLAS_",
    "CUDA",
    "NCCL_",
    "GLOO_",
    "LD_",
    "MALLOC",
    "GLIBC_",
    "PYTHON",
    "LANG",
    "LC_",
    "TMP",
    "TEMP",
)
# A server imports for seconds; far longer means it is broken (the call then starts cold).
_READY_TIMEOUT_S = 300.0
_MODULE = "tests._zygote_main"


def enabled() -> bool:
    """False with ``RESTARTABLE_COLD_RANKS=1``: every rank starts as a fresh interpreter."""
    return os.environ.get("RESTARTABLE_COLD_RANKS", "") in ("", "0")


def compatible(base: Mapping[str, str], env: Mapping[str, str]) -> bool:
    """Whether ranks with environment ``env`` may be forked from servers started with ``base``:
    every variable read at import time (``IMPORT_TIME_PREFIXES``) has the same value in both."""
    keys = {k for k in (*base, *env) if k.startswith(IMPORT_TIME_PREFIXES)}
    return all(base.get(k) == env.get(k) for k in keys)


class _Server:
    """One ``tests._zygote_main`` process and the exit statuses it reported."""

    def __init__(self, env: Mapping[str, str], cwd: Path) -> None:
        self.env = dict(env)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", _MODULE],
            cwd=cwd,
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        self.ready = False
        self.exits: dict[int, int] = {}
        self._buffer = b""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_ready(self, timeout: float) -> bool:
        """Block until the server said ready (at most ``timeout`` s); False if it did not."""
        if not self.ready:
            line = self._line(timeout)
            self.ready = line == "ready"
        return self.ready

    def fork(self, request: dict[str, object]) -> int:
        """Ask for one child; its pid."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        self.proc.stdin.flush()
        while True:
            line = self._line(_READY_TIMEOUT_S)
            if line.startswith("pid "):
                return int(line.split()[1])
            if not line:
                raise OSError(f"rank server pid {self.proc.pid} ended: status {self.proc.poll()}")

    def drain(self, timeout: float = 0.0) -> None:
        """Record every exit reported by now (waiting at most ``timeout`` s for the first)."""
        while True:
            line = self._line(timeout)
            if not line:
                return
            timeout = 0.0

    def _line(self, timeout: float) -> str:
        """The next line (exits recorded on the way); "" when none came in ``timeout`` s or the
        server is gone."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            if not select.select([fd], [], [], timeout)[0]:
                return ""
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return ""
            self._buffer += chunk
        raw, self._buffer = self._buffer.split(b"\n", 1)
        line = raw.decode()
        if line.startswith("exit "):
            _, pid, status = line.split()
            self.exits[int(pid)] = int(status)
        return line

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        self.proc.wait()


class ForkedRank:
    """A rank forked by a server: the part of ``subprocess.Popen`` tests use (``pid``, ``args``,
    ``returncode``, ``poll``, ``wait``, ``send_signal``, ``kill``, ``terminate``)."""

    def __init__(self, server: _Server, pid: int, args: Sequence[str]) -> None:
        self._server = server
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._server.drain()
            self._settle()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Block until the rank ended (``subprocess.TimeoutExpired`` after ``timeout`` s)."""
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = 0.1 if end is None else min(0.1, end - time.monotonic())
            if left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self._server.drain(left)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def _settle(self) -> None:
        status = self._server.exits.pop(self.pid, None)
        if status is not None:
            self.returncode = status
        elif not self._server.alive():  # its parent is gone: nobody can say; it is not ours
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)
            self.returncode = -signal.SIGKILL


_servers: dict[int, _Server] = {}


def _close_all() -> None:
    for server in _servers.values():
        server.close()
    _servers.clear()


atexit.register(_close_all)


def servers(n: int, env: Mapping[str, str], cwd: Path) -> list[_Server] | None:
    """The ready servers of rank indices 0..n-1 for ranks with environment ``env`` (started or
    restarted as needed); None when this call must start its ranks cold."""
    if not enabled():
        return None
    for i in range(n):
        old = _servers.get(i)
        if old is not None and (not old.alive() or not compatible(old.env, env)):
            old.close()
            del _servers[i]
        if i not in _servers:
            _servers[i] = _Server(_server_env(env), cwd)
    if not all(_servers[i].wait_ready(_READY_TIMEOUT_S) for i in range(n)):
        return None
    return [_servers[i] for i in range(n)]


def _server_env(env: Mapping[str, str]) -> dict[str, str]:
    """A server's environment: the first call's ranks' (what differs between calls is checked
    by ``compatible`` on every call; the rest is replaced in each child before it imports)."""
    return dict(env)


def fork_rank(
    server: _Server, argv: Sequence[str], *, env: Mapping[str, str], cwd: Path, log: Path
) -> ForkedRank:
    """Fork ``python -m tests._rank_main argv...`` (``argv`` without the interpreter and
    ``-m MODULE``) from ``server`` with ``env``, output appended to ``log``."""
    module = "tests._rank_main"
    request = {
        "module": module,
        "argv": [str(Path(cwd) / "tests" / "_rank_main.py"), *argv],
        "env": dict(env),
        "cwd": str(cwd),
        "log": str(log),
        "umask": _umask(),
    }
    pid = server.fork(request)
    return ForkedRank(server, pid, [sys.executable, "-m", module, *argv])


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
