"""The one helper that runs N real ranks on CPU/gloo for multi-process tests.

Every rank is a process of its own (no fork of the pytest process), on a free localhost port,
under a per-test deadline: a fresh ``python`` for a script, and for a target a fork of a server
that has imported torch already (``tests.rank_zygote``: the same start as ``python -m``, less the
seconds of the torch import; ``RESTARTABLE_COLD_RANKS=1`` starts fresh interpreters instead).
When anything goes wrong the failure message carries every rank's exit status and its full
output, tracebacks included.

Two ways to say what a rank runs:

* ``target="tests.dist.workers:fn"`` calls ``fn(**kwargs)`` in each rank; its JSON-serialisable
  return value comes back as ``RankOutput.result``.
* ``argv=["examples/demo.py", "--steps", "3"]`` runs a script (``python argv...``) in each rank.

Environment given to each rank: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK (the
simulated node index), MASTER_ADDR, MASTER_PORT, PYTHONPATH (the repository root first),
PYTHONUNBUFFERED=1, TEST_RESULT_DIR, plus ``env``.

``host_store=True`` hosts a ``torch.distributed.TCPStore`` server in the test process on
MASTER_PORT and sets ``INPROCESS_STORE_HOSTED=1``, the same contract as ``inprocess.launch``:
the store outlives every rank, so killing rank 0 does not take the store with it.

``restart_by="node"`` (with ``host_store``; default: ``$RESTARTABLE_TEST_RESTART_BY``, else
"rank") also does what ``inprocess.launch`` does by default for each simulated node: it hosts
the launcher's own ``NodeHost`` (a node store and the relay thread), names it to the node's
ranks in ``RESTARTABLE_NODE_STORE``, hands every rank one job secret (``RESTARTABLE_SECRET``,
the relay seals with it as the ranks do) and tells the relay which of its ranks exited. So a
suite written against ``run_ranks`` runs the restart by node with
``RESTARTABLE_TEST_RESTART_BY=node``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

if __package__:
    from tests import rank_zygote
else:  # imported as ``multiproc`` by a script run from tests/ (python tests/slurm_cluster.py)
    import rank_zygote  # type: ignore[no-redef]

REPO_ROOT = Path(__file__).resolve().parents[1]
_POLL_S = 0.02


def slow(why: str) -> pytest.MarkDecorator:
    """Skip a test unless ``RESTARTABLE_SLOW_TESTS=1``: the default suite must stay well under
    15 minutes on a 2-core machine, so a case that is slow and whose behaviour default tests
    mostly cover runs on request. ``why``: what makes it slow, or what covers it by default."""
    return pytest.mark.skipif(
        not os.environ.get("RESTARTABLE_SLOW_TESTS"),
        reason=f"slow ({why}): set RESTARTABLE_SLOW_TESTS=1 to run it",
    )


def startup_s() -> float:
    """Seconds a fresh interpreter takes now to import ``torch.distributed``: the start-up of
    one rank, measured under the machine's present load (it grows with the load: 6.4 s at load
    6 on the 2-core host).

    For a deadline derived from what a test waits for: the waits it has by design plus the
    start-up of its ranks, instead of one fixed guess that a loaded machine overruns."""
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", "import torch.distributed"], check=True, timeout=300)
    return time.monotonic() - t0


@dataclass
class RankOutput:
    """What one rank process did."""

    rank: int
    pid: int
    returncode: int | None  # None: still running at the deadline, then killed
    output: str  # stdout and stderr, interleaved
    result: Any  # the target's return value (JSON), None for scripts or failures


class RanksFailed(AssertionError):
    """A multi-process test failed; the message holds every rank's status and output."""


def wait_for_output(
    log: Path, text: str, proc: subprocess.Popen[bytes], *, deadline: float
) -> None:
    """Poll ``log`` (a running job's output file) until it holds ``text``; fail with the output
    when ``proc`` ended first or ``deadline`` seconds passed."""
    end = time.monotonic() + deadline
    while text not in log.read_text(errors="replace"):
        assert proc.poll() is None, log.read_text(errors="replace")
        assert time.monotonic() < end, f"no {text!r} in time:\n{log.read_text(errors='replace')}"
        time.sleep(0.02)


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports on localhost that were free a moment ago.

    All ``n`` sockets stay bound until every port is known: the kernel may hand out a port it
    just released again, so ports taken one at a time can repeat (an etcd cluster once got the
    same peer port for two members).
    """
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]


def free_port() -> int:
    """A TCP port on localhost that was free a moment ago (one port: see ``free_ports``)."""
    return free_ports(1)[0]


def describe(outputs: Sequence[RankOutput]) -> str:
    """Every rank's status and full output, for failure messages."""
    parts = []
    for o in outputs:
        status = "killed at deadline" if o.returncode is None else f"exit {o.returncode}"
        parts.append(f"----- rank {o.rank} (pid {o.pid}, {status}) -----\n{o.output}")
    return "\n".join(parts)


def run_ranks(
    nprocs: int,
    *,
    target: str | None = None,
    argv: Sequence[str] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    deadline: float = 60.0,
    env: Mapping[str, str] | None = None,
    local_world_size: int | None = None,
    host_store: bool = False,
    expect_success: bool = True,
    on_started: Any = None,
    restart_by: str | None = None,
) -> list[RankOutput]:
    """Start ``nprocs`` ranks, wait for all of them (at most ``deadline`` s), return their outputs.

    Raises ``RanksFailed`` when the deadline passes (all ranks are killed first) or, with
    ``expect_success``, when any rank exits non-zero. ``on_started(procs)`` is called once all
    processes exist, with the list of ``subprocess.Popen`` objects (for tests that signal a
    rank; a forked rank's object has the same ``pid``, ``args``, ``poll``, ``wait``,
    ``send_signal``, ``kill``). ``restart_by``: see the module docstring.
    """
    if restart_by is None:  # the suite's choice; a job without a hosted store has no launcher
        restart_by = os.environ.get("RESTARTABLE_TEST_RESTART_BY", "rank") if host_store else "rank"
    if restart_by not in ("rank", "node") or (restart_by == "node" and not host_store):
        raise ValueError(
            f"restart_by={restart_by!r}: 'rank', or 'node' with host_store=True (the relay "
            "speaks to the store the test hosts)"
        )
    if (target is None) == (argv is None):
        raise ValueError("run_ranks needs exactly one of target= or argv=")
    lws = local_world_size or nprocs
    if nprocs % lws:
        raise ValueError(f"local_world_size ({lws}) must divide nprocs ({nprocs})")

    workdir = Path(tempfile.mkdtemp(prefix="ranks-"))
    store = None
    if host_store:
        from torch.distributed import TCPStore

        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        port = store.port
    else:
        port = free_port()

    base_env = dict(os.environ)
    base_env.update(
        {
            "WORLD_SIZE": str(nprocs),
            "LOCAL_WORLD_SIZE": str(lws),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "PYTHONPATH": os.pathsep.join(
                [str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
            "PYTHONUNBUFFERED": "1",
            "TEST_RESULT_DIR": str(workdir),
        }
    )
    if host_store:
        base_env["INPROCESS_STORE_HOSTED"] = "1"
    base_env.update(env or {})
    procs: list[Any] = []  # subprocess.Popen, or rank_zygote.ForkedRank (the same interface)
    nodes: list[Any] = []  # restart_by="node": one NodeHost per simulated node
    if restart_by == "node":
        nodes = _node_hosts(nprocs, lws, port, base_env, procs)

    warm = None
    if target is not None:
        module, _, func = target.partition(":")
        kwargs_file = workdir / "kwargs.json"
        kwargs_file.write_text(json.dumps(dict(kwargs or {})))
        rank_args = [f"{module}:{func}", str(kwargs_file)]
        cmd = [sys.executable, "-m", "tests._rank_main", *rank_args]
        # Forked from servers that imported torch already (tests/rank_zygote.py says what
        # stays as in a fresh interpreter); None: cold starts.
        warm = rank_zygote.servers(nprocs, base_env, REPO_ROOT)
    else:
        cmd = [sys.executable, *(argv or [])]

    logs = []
    stuck: set[int] = set()
    try:
        for rank in range(nprocs):
            rank_env = dict(base_env)
            rank_env.update(
                {
                    "RANK": str(rank),
                    "LOCAL_RANK": str(rank % lws),
                    "GROUP_RANK": str(rank // lws),
                    **(nodes[rank // lws].env() if nodes else {}),
                }
            )
            log = open(workdir / f"rank{rank}.log", "wb")  # noqa: SIM115 - closed below
            logs.append(log)
            if warm is not None:
                procs.append(
                    rank_zygote.fork_rank(
                        warm[rank],
                        rank_args,
                        env=rank_env,
                        cwd=REPO_ROOT,
                        log=workdir / f"rank{rank}.log",
                    )
                )
                continue
            procs.append(
                subprocess.Popen(
                    cmd,
                    cwd=REPO_ROOT,
                    env=rank_env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    # Own process group: the deadline kill reaches the rank's children too.
                    start_new_session=True,
                )
            )
        if on_started is not None:
            on_started(procs)
        end = time.monotonic() + deadline
        while any(p.poll() is None for p in procs) and time.monotonic() < end:
            time.sleep(_POLL_S)
        stuck = {i for i, p in enumerate(procs) if p.poll() is None}
    finally:
        for p in procs:
            if p.poll() is None:
                _kill_group(p)
        for log in logs:
            log.close()
        for node in nodes:
            node.close()
        del store  # the server stops only after every rank has exited

    timed_out = bool(stuck)
    outputs = []
    for rank, p in enumerate(procs):
        text = (workdir / f"rank{rank}.log").read_bytes().decode(errors="replace")
        result_file = workdir / f"result.{rank}.json"
        result = json.loads(result_file.read_text()) if result_file.exists() else None
        outputs.append(
            RankOutput(
                rank=rank,
                pid=p.pid,
                returncode=None if rank in stuck else p.returncode,
                output=text,
                result=result,
            )
        )
    if timed_out:
        raise RanksFailed(
            f"ranks still running after the {deadline:.0f} s deadline\n" + describe(outputs)
        )
    if expect_success and any(o.returncode != 0 for o in outputs):
        raise RanksFailed("a rank exited non-zero\n" + describe(outputs))
    return outputs


def _node_hosts(
    nprocs: int,
    lws: int,
    port: int,
    base_env: dict[str, str],
    procs: Sequence[Any],
) -> list[Any]:
    """One launcher-side ``NodeHost`` per simulated node of ``lws`` ranks, relaying to the
    store on ``port``; ``base_env`` gets the job secret the relays seal with. ``procs`` (filled
    later, rank order) is what the relays read: a rank whose process exited is dead."""
    from restartable.checkpoint.sealing import SECRET_ENV, Sealer, new_secret
    from restartable.inprocess.launch.node_host import NodeHost

    secret = base_env.setdefault(SECRET_ENV, new_secret())
    sealer = Sealer(bytes.fromhex(secret))

    def dead_local() -> list[int]:
        return [r for r, p in enumerate(tuple(procs)) if p.poll() is not None]

    return [
        NodeHost(
            node=k,
            round_=0,
            job_addr="127.0.0.1",
            job_port=port,
            sealer=sealer,
            dead_local=dead_local,
            gone_nodes=frozenset,
            barrier_timeout=60.0,
        )
        for k in range(nprocs // lws)
    ]


def _kill_group(p: Any) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGKILL)
    p.wait()


@dataclass
class JobOutput:
    """What a whole launched job (launcher + ranks) did."""

    returncode: int
    output: str


def run_job(
    argv: Sequence[str],
    *,
    deadline: float,
    env: Mapping[str, str] | None = None,
    signal_when: tuple[str | tuple[str, ...], int] | None = None,
    cwd: Path | None = None,
    umask: int = -1,
) -> JobOutput:
    """Run ``python argv...`` (e.g. ``-m restartable.launch ...``) from ``cwd`` (the repo root),
    under ``umask`` when given (-1: this process's).

    ``signal_when=(text, signum)`` sends ``signum`` to the job's main process once ``text``
    (or every text of a tuple) appears in its output (for preemption tests). Raises
    ``RanksFailed`` with the whole output when the deadline passes (the job's process group is
    killed first).
    """
    full_env = dict(os.environ)
    full_env.update(
        {
            "PYTHONPATH": os.pathsep.join(
                [str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
            "PYTHONUNBUFFERED": "1",
        }
    )
    full_env.update(env or {})
    log_path = Path(tempfile.mkdtemp(prefix="job-")) / "job.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, *argv],
            cwd=cwd or REPO_ROOT,
            env=full_env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            umask=umask,
        )
        end = time.monotonic() + deadline
        signalled = signal_when is None
        texts = () if signal_when is None else signal_when[0]
        texts = (texts,) if isinstance(texts, str) else texts
        try:
            while proc.poll() is None and time.monotonic() < end:
                if not signalled and signal_when is not None:
                    seen = log_path.read_bytes().decode(errors="replace")
                    if all(t in seen for t in texts):
                        proc.send_signal(signal_when[1])
                        signalled = True
                time.sleep(_POLL_S)
        finally:
            stuck = proc.poll() is None
            if stuck:
                _kill_group(proc)
    text = log_path.read_bytes().decode(errors="replace")
    if stuck:
        raise RanksFailed(f"job still running after the {deadline:.0f} s deadline\n{text}")
    return JobOutput(returncode=proc.returncode, output=text)
