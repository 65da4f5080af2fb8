"""The warm pool's server process: imports torch (and the modules named) once, then forks a new
rank process per request, so a respawned or restarted rank skips the interpreter's start and the
imports (``inprocess.launch.pool`` is the launcher's side; docs/launching.md#warm-pool).

Run as ``python -m restartable.inprocess.forkserver --socket PATH --launcher-pid PID --preload
M,...`` by ``WarmPool.start()`` only. What may be preloaded: modules whose import starts no thread,
creates no CUDA context and opens no socket or file it keeps (torch, numpy, the framework, the
model's code). A fork copies only the calling thread: a thread started at import would be
missing in every rank, a CUDA context or a socket would be shared with each of them.

Protocol, one AF_UNIX SOCK_SEQPACKET connection per rank: the launcher sends one message, a JSON
``{"argv": [...], "env": {...}, "cwd": ...}`` with the write end of the rank's output pipe
attached (SCM_RIGHTS); the server answers ``pid <n>`` once forked, then ``exit <status>`` when
the rank ended (negative: killed by that signal, as ``subprocess``), and closes the connection.
Before it says ready, the server also imports what a rank's first DDP / FSDP2 imports
(``inprocess.restart.warmup``, about 2 s of one core), on a thread of the lowest CPU priority so
that it takes only what the first round's ranks leave (the thread's priority, not the process's:
the ranks it forks must not inherit it). Ready therefore means that every fork happens while the
server is single-threaded (a fork from it is safe) and is answered at once: until then the
launcher starts ranks cold. (Saying ready before the imports ended made the first request wait
for them: on a loaded machine longer than the launcher's answer timeout, which turned the warm
pool off for the rest of the job.) The server dies with the launcher (PR_SET_PDEATHSIG); each
rank binds itself to the server the same way (INPROCESS_LAUNCHER_PID).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import select
import signal
import socket
import sys
import traceback
from collections.abc import Sequence

from restartable.checkpoint import sealing
from restartable.inprocess.forkserver.wire import MAX_REQUEST, READY_LINE
from restartable.inprocess.script_mode.entry import run_script

_REAP_S = 0.02  # how often the server looks for ranks that ended


def main(argv: Sequence[str]) -> int:
    """Preload, listen, import what a first DDP imports, say ready on stdout, then serve until
    the launcher is gone."""
    args = _parse(argv)
    from restartable.inprocess.protocol.environment import bind_to_launcher

    bind_to_launcher(args.launcher_pid)
    for name in filter(None, args.preload.split(",")):
        try:
            importlib.import_module(name)
        except Exception as exc:  # a rank that needs it imports it again and fails there
            print(f"warm pool: cannot preload {name}: {exc!r}", file=sys.stderr, flush=True)
    from restartable.inprocess.restart.warmup import FirstUseImports

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(args.socket)
    listener.listen(64)
    imports = FirstUseImports()
    imports.start()
    imports.wait()  # fork only single-threaded: the child would miss the thread
    os.write(1, READY_LINE)
    ranks: dict[int, socket.socket] = {}
    while os.getppid() == args.launcher_pid:
        readable, _, _ = select.select([listener], [], [], _REAP_S)
        if readable:
            _serve_one(listener, ranks)
        _reap(ranks)
    return 0


def _serve_one(listener: socket.socket, ranks: dict[int, socket.socket]) -> None:
    conn, _ = listener.accept()
    try:
        msg, fds, _, _ = socket.recv_fds(conn, MAX_REQUEST, 1)
        request = json.loads(msg)
    except Exception as exc:
        print(f"warm pool: bad request: {exc!r}", file=sys.stderr, flush=True)
        conn.close()
        return
    if len(fds) != 1:
        conn.close()
        return
    pid = os.fork()
    if pid == 0:  # the rank: ends as the interpreter (atexit handlers, stdio flushed)
        listener.close()
        for c in ranks.values():
            c.close()
        conn.close()
        raise SystemExit(_run_rank(request, fds[0]))
    os.close(fds[0])
    conn.sendall(f"pid {pid}".encode())
    ranks[pid] = conn


def _reap(ranks: dict[int, socket.socket]) -> None:
    while ranks:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = ranks.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):  # the launcher stopped listening
                conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}".encode())
            conn.close()


def _run_rank(request: dict[str, object], out_fd: int) -> int:
    """In the forked child: become the rank process ``python argv...`` would have been, run the
    script, and return its exit status (the caller raises SystemExit with it)."""
    code = 1
    try:
        os.setsid()  # as subprocess's start_new_session: a terminal's Ctrl-C reaches us only
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        os.close(out_fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        argv = [str(a) for a in request["argv"]]  # type: ignore[attr-defined]
        os.environ.clear()
        os.environ.update({str(k): str(v) for k, v in request["env"].items()})  # type: ignore[attr-defined]
        sealing.take_from_environ()  # before the script: its children never inherit it
        os.chdir(str(request["cwd"]))
        sys.argv = argv
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # as `python script.py`
        run_script(argv[0])
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except BaseException:
        traceback.print_exc()
    return code


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m restartable.inprocess.forkserver", allow_abbrev=False
    )
    p.add_argument("--socket", required=True)
    p.add_argument("--launcher-pid", type=int, required=True)
    p.add_argument("--preload", default="")
    return p.parse_args(list(argv))
