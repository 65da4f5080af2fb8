"""The process that ``tests.rank_zygote`` forks test ranks from: ``python -m tests._zygote_main``.

It imports torch and torch.distributed once (what a rank's fresh interpreter spends most of its
start-up on: about 1.8 s of one core here, 6 s and more at load 6 on the 2-core host), says
``ready`` on stdout, then serves requests, one JSON line each on stdin::

    {"argv": [...], "module": "tests._rank_main", "env": {...}, "cwd": "...",
     "log": "/path/rankN.log", "umask": 18}

and answers, on stdout, ``pid N`` once forked and ``exit N STATUS`` when that child ended
(STATUS as ``subprocess.Popen.returncode``: negative for a signal). Nothing of the framework is
imported here: every ``restartable`` module, the target's and the test's are imported fresh in
the child, under the child's environment, as in a new ``python -m`` process.

The child becomes what ``python -m MODULE ARGS`` started with ``start_new_session=True`` would
be: its own session, stdin from /dev/null, stdout and stderr to the log, the request's
environment, working directory, umask and ``sys.argv``; it ends through the interpreter's normal
exit (non-daemon threads joined, atexit handlers run), and an uncaught exception prints its
traceback and exits 1. The server only reads stdin: when the test process is gone (EOF) it
exits; a child outlives it as a fresh process would.

The server must never run a tensor operation itself: a child forked after an OpenMP parallel
region of its parent hangs in its own first one (measured here with torch 2.13's libgomp, a
2000 x 2000 matmul in the parent: the child's matmul never returned), while forks after the bare
imports run theirs (the worker thread that ``import torch`` leaves is started anew in the child).
"""

from __future__ import annotations

import json
import os
import runpy
import select
import sys
import traceback
from typing import Any

_REAP_S = 0.02  # how often ended children are looked for; a rank's poll is as fine


def main() -> None:
    import torch.distributed  # noqa: F401 - the point of this process (torch with it)

    os.write(1, b"ready\n")
    children: set[int] = set()
    pending = b""
    while True:
        readable, _, _ = select.select([0], [], [], _REAP_S)
        if readable:
            chunk = os.read(0, 1 << 16)
            if not chunk:  # the test process is gone
                return
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                children.add(_fork(json.loads(line)))
        _reap(children)


def _fork(request: dict[str, Any]) -> int:
    """Fork one child and answer its pid once it leads its own session (so that the test may
    signal its process group at once, as after ``Popen(start_new_session=True)``)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        os.setsid()
        os.close(write_end)  # the parent's read sees EOF: the session exists
        raise SystemExit(_become(request))
    os.close(write_end)
    os.read(read_end, 1)
    os.close(read_end)
    os.write(1, f"pid {pid}\n".encode())
    return pid


def _reap(children: set[int]) -> None:
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        children.discard(pid)
        os.write(1, f"exit {pid} {os.waitstatus_to_exitcode(status)}\n".encode())


def _become(request: dict[str, Any]) -> int:
    """In the forked child (already in its own session): run ``request["module"]`` as
    ``__main__``; its exit status."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    sys.argv = list(request["argv"])
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        return _exit_status(exc.code)
    except BaseException:  # as the interpreter does with an uncaught exception
        traceback.print_exc()
        return 1
    return 0


def _exit_status(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    main()
