"""``python -m restartable.inprocess.srun_task SCRIPT [ARGS]``: one srun task that runs one rank as
its child and exits with the job's outcome, not only its rank's.

    srun --kill-on-bad-exit=0 python -m restartable.inprocess.srun_task train.py --steps 1000
    srun --kill-on-bad-exit=0 python -m restartable.inprocess.srun_task -m restartable.launch ...

Under ``srun --kill-on-bad-exit=0`` a rank that was killed (a fault the job survived: a warm
reserve took its place and the job finished) would otherwise make srun exit 137 and Slurm record
the job as FAILED. This process stays in the task's place (stdlib only; it imports torch only
after its rank was killed, to read the job's outcome):

- its rank exits by itself: this process exits with the same status (0 finished, 75 preempted
  or requeue, 16 / 17 rerun verdicts, any other failure);
- its rank is killed by a signal (SIGKILL, a hard-timeout kill, the OOM killer): it reads the
  job's state in the coordination store until the job ends, marks the rank as left (the store
  server waits for it: ``store_server --wait-for-tasks``), and exits 0 when the job finished,
  otherwise 128 + the signal (like a shell).

With ``-m restartable.launch`` the child is a node's launcher (one task per node, several nodes):
when it is killed (its ranks die with it), the task stands in for it (``stand_in``) until a
surviving launcher recorded the job's end status (the end record next to the
``--autoresume-file`` flag, else ``launch/end`` in node 0's control store, where it beats and
leaves in the dead launcher's name), and exits with that status (0: the job finished on the
other nodes; 75: requeue). When node 0's launcher is the one killed, its store is gone: the
others end with 75 and record it, and node 0's task exits 75 too (unknown, 128 + the signal,
only when no record comes within ``--node-timeout``).

It is a child subreaper (Linux): the processes its rank started and left behind (the store
server of rank 0, a dead rank's watchdog) become its children, so every proctrack plugin keeps
them inside the step, and at its exit it waits ``--orphan-grace`` seconds for them to end on
their own (the store server ends when every rank has left), then kills them: nothing outlives
the task. SIGTERM / SIGINT are passed to the rank (a preemption notice); this process itself
ends when its rank has.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from restartable.inprocess.clock import SYSTEM, Clock
from restartable.inprocess.protocol.environment import ENV_TASK, LaunchEnv
from restartable.inprocess.protocol.store import Store
from restartable.inprocess.srun_task.stand_in import launcher_job_status

log = logging.getLogger("restartable.inprocess.srun_task")
# ``-m`` modules that are a node's launcher: its full name and the short one users type.
LAUNCHER_MODULES = ("restartable.launch", "restartable.inprocess.launch")

_PR_SET_CHILD_SUBREAPER = 36
_OUTCOME_POLL_S = 0.5  # how often a dead rank's task looks at the job's state
_VALUED = ("--orphan-grace", "--outcome-timeout")  # the task's options that take a value


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The task's options, then ``SCRIPT ARGS`` or ``-m MODULE ARGS`` (``module`` is None or
    the module; ``script`` the script or the module)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    module, rest = None, []
    i = 0
    while i < len(argv) and argv[i].startswith("-"):  # the task's own options come first
        if argv[i] == "-m" and i + 1 < len(argv):  # the rest belongs to the module
            module, rest, argv = argv[i + 1], argv[i + 2 :], [*argv[:i], argv[i + 1]]
            break
        i += 2 if argv[i] in _VALUED else 1
    p = argparse.ArgumentParser(
        prog="python -m restartable.inprocess.srun_task",
        allow_abbrev=False,
        description="Run one rank as a child; exit with the job's outcome (module docstring).",
    )
    p.add_argument(
        "--orphan-grace",
        type=float,
        default=60.0,
        help="seconds the processes the rank left behind (store server) get to end on their "
        "own once the rank is gone, before they are killed (default 60)",
    )
    p.add_argument(
        "--outcome-timeout",
        type=float,
        default=3600.0,
        help="after the rank was killed: the longest wait for the job's end (default 3600)",
    )
    p.add_argument("script", help="the training script")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the script")
    args = p.parse_args(argv)
    args.module = module
    if module is not None:
        args.args = rest
    for name in ("orphan_grace", "outcome_timeout"):
        if not getattr(args, name) >= 0:
            p.error(f"--{name.replace('_', '-')} ({getattr(args, name)}) must be >= 0 seconds")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the rank; return the task's exit status (module docstring)."""
    args = parse_args(argv)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter("[restartable.inprocess.srun_task %(process)d] %(message)s")
    )
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    _become_subreaper()
    # Same process group as this task: a scheduler that signals the group reaches the rank.
    target = ["-m", args.module] if args.module is not None else [args.script]
    child = subprocess.Popen(
        [sys.executable, *target, *args.args], env={**os.environ, ENV_TASK: "1"}
    )

    def forward(signum: int, frame: FrameType | None) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    rc = child.wait()
    status = rc if rc >= 0 else _after_kill(-rc, args, SYSTEM)
    _end_orphans(args.orphan_grace, SYSTEM)
    return status


def task_status(returncode: int, job_status: int | None) -> int:
    """The task's exit status for its child's ``returncode`` (Popen's: negative = killed by
    that signal) and the job's status once it ended without the child (None: unknown, or the
    job failed: the surviving tasks report that)."""
    if returncode >= 0:
        return returncode
    return job_status if job_status is not None else 128 - returncode


def _after_kill(signum: int, args: argparse.Namespace, clock: Clock) -> int:
    """The child was killed: wait for the job's outcome in the store; the task's status."""
    name = _signal_name(signum)
    what = "launcher" if args.module in LAUNCHER_MODULES else "rank"
    try:
        if what == "launcher":
            job_status = launcher_job_status(args.args, args.outcome_timeout, clock)
        else:
            job_status = 0 if _job_done(args.outcome_timeout, clock) else None
    except Exception as exc:  # no store, no job: the kill stands as this task's failure
        log.warning("%s killed by %s; the job's outcome is unknown (%s)", what, name, exc)
        job_status = None
    status = task_status(-signum, job_status)
    if job_status == 0:
        log.info("%s killed by %s; the job finished without it: exit 0", what, name)
    else:
        log.warning("%s killed by %s and the job did not finish: exit %d", what, name, status)
    return status


def _job_done(timeout: float, clock: Clock) -> bool | None:
    """Connect to the job's store; block until the job is done (True) or stopped (False);
    then mark this task's rank as left. None when it never became a ``@restartable`` job."""
    from restartable.checkpoint.sealing import job_sealer
    from restartable.inprocess.protocol import job_keys
    from restartable.inprocess.protocol.environment import read_env
    from restartable.inprocess.protocol.sealed_store import seal
    from restartable.inprocess.store_server import mark_left

    env = read_env()
    # Sealed like the ranks' own values (the rank made the job's secret; we share its env).
    store = seal(_job_store(env), job_sealer(create=False))
    deadline = clock.monotonic() + timeout
    state = job_keys.job_state(store)
    while state == job_keys.JOB_RUNNING and clock.monotonic() < deadline:
        clock.sleep(_OUTCOME_POLL_S)
        state = job_keys.job_state(store)
    with contextlib.suppress(Exception):
        mark_left(store, env.identity)
    if state == job_keys.JOB_NOT_STARTED:
        return None
    return state == job_keys.JOB_DONE


def _job_store(env: LaunchEnv) -> Store:
    """A client of the rank's job store, as the rank found it (etcd or the hosted TCPStore)."""
    from restartable.inprocess.protocol.store import as_store
    from restartable.inprocess.store_server import client

    if env.store_url is not None:
        from restartable.inprocess.etcd.connect import open_store

        return open_store(env.store_url, job_id=env.job_id, timeout=30.0)
    return as_store(client(env.master_addr, env.master_port, timeout=30.0))


def _become_subreaper() -> None:
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        log.warning("not a child subreaper: the rank's orphans are not watched")


def _end_orphans(grace: float, clock: Clock) -> None:
    """Reap the processes the rank left behind; kill those alive after ``grace`` seconds."""
    deadline = clock.monotonic() + grace
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return  # none left
        if pid:
            continue
        if clock.monotonic() >= deadline:
            break
        clock.sleep(0.1)
    for pid in _children():
        log.warning("killing pid %d, left behind by the rank (%.0f s after it)", pid, grace)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, 0)[0]:
            pass


def _children() -> list[int]:
    me = os.getpid()
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == me:
                out.append(int(stat.parent.name))
    return out


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
