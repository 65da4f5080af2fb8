"""``python -m inprocess.task SCRIPT [ARGS]``: one srun task that runs one rank as its child and
exits with the job's outcome, not only its rank's.

    srun --kill-on-bad-exit=0 python -m inprocess.task train.py --steps 1000

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
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from inprocess.environment import ENV_TASK

log = logging.getLogger("inprocess.task")

_PR_SET_CHILD_SUBREAPER = 36
_OUTCOME_POLL_S = 0.5  # how often a dead rank's task looks at the job's state


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m inprocess.task",
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
    for name in ("orphan_grace", "outcome_timeout"):
        if not getattr(args, name) >= 0:
            p.error(f"--{name.replace('_', '-')} ({getattr(args, name)}) must be >= 0 seconds")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the rank; return the task's exit status (module docstring)."""
    args = parse_args(argv)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[inprocess.task %(process)d] %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    _become_subreaper()
    # Same process group as this task: a scheduler that signals the group reaches the rank.
    child = subprocess.Popen(
        [sys.executable, args.script, *args.args], env={**os.environ, ENV_TASK: "1"}
    )

    def forward(signum: int, frame: FrameType | None) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    rc = child.wait()
    status = rc if rc >= 0 else _after_kill(-rc, args.outcome_timeout)
    _end_orphans(args.orphan_grace)
    return status


def task_status(returncode: int, job_done: bool | None) -> int:
    """The task's exit status for its rank's ``returncode`` (Popen's: negative = killed by that
    signal) and whether the job finished (None: unknown, or not a ``@restartable`` job)."""
    if returncode >= 0:
        return returncode
    return 0 if job_done else 128 - returncode


def _after_kill(signum: int, timeout: float) -> int:
    """The rank was killed: wait for the job's outcome in the store; the task's status."""
    name = _signal_name(signum)
    try:
        done = _job_done(timeout)
    except Exception as exc:  # no store, no job: the kill stands as this task's failure
        log.warning("rank killed by %s; the job's outcome is unknown (%s)", name, exc)
        done = None
    if done:
        log.info("rank killed by %s; the job finished without it: exit 0", name)
    else:
        log.warning("rank killed by %s and the job did not finish: exit %d", name, 128 + signum)
    return task_status(-signum, done)


def _job_done(timeout: float) -> bool | None:
    """Connect to the job's store; block until the job is done (True) or stopped (False);
    then mark this task's rank as left. None when it never became a ``@restartable`` job."""
    from inprocess import respawn
    from inprocess.environment import read_env
    from inprocess.store_server import client, mark_left

    env = read_env()
    store: Any
    if env.store_url is not None:
        from inprocess.etcd.connect import open_store

        store = open_store(env.store_url, job_id=env.job_id, timeout=30.0)
    else:
        store = client(env.master_addr, env.master_port, timeout=30.0)
    deadline = time.monotonic() + timeout
    state = respawn.job_state(store)
    while state == respawn.JOB_RUNNING and time.monotonic() < deadline:
        time.sleep(_OUTCOME_POLL_S)
        state = respawn.job_state(store)
    with contextlib.suppress(Exception):
        mark_left(store, env.identity)
    if state == respawn.JOB_NOT_STARTED:
        return None
    return state == respawn.JOB_DONE


def _become_subreaper() -> None:
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        log.warning("not a child subreaper: the rank's orphans are not watched")


def _end_orphans(grace: float) -> None:
    """Reap the processes the rank left behind; kill those alive after ``grace`` seconds."""
    deadline = time.monotonic() + grace
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return  # none left
        if pid:
            continue
        if time.monotonic() >= deadline:
            break
        time.sleep(0.1)
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


if __name__ == "__main__":
    sys.exit(main())
