"""Rank functions for the in-process restart tests (run through tests.multiproc.run_ranks)."""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from restartable.inprocess import context, restartable
from restartable.inprocess import faults as fi

FAST = {
    # CPU tensors: gloo, also on a host with a GPU (where the default backend is nccl).
    "backend": "gloo",
    "soft_timeout": 2.0,
    "hard_timeout": 6.0,
    "heartbeat_interval": 0.5,
    "barrier_timeout": 30.0,
    "completion_timeout": 30.0,
}


_SYNC_S = 20.0  # bound of every wait for a peer's signal: reached only when the test is broken


def _allreduce_sum(value: float) -> float:
    t = torch.tensor([value])
    dist.all_reduce(t)
    return float(t.item())


class SyncTimeout(BaseException):
    """A peer never reached the point this rank waits for.

    A BaseException: ``@restartable`` lets it end the rank (a failed test) instead of taking it
    for a fault to restart from.
    """


def _wait_until(condition: Any, what: str) -> None:
    # Polls, running bytecode between checks: a main thread blocked in one C call (a store
    # wait) for longer than soft_timeout would itself be blamed for a hang.
    deadline = time.monotonic() + _SYNC_S
    while not condition():
        if time.monotonic() > deadline:
            raise SyncTimeout(f"not within {_SYNC_S} s: {what}")
        time.sleep(0.005)


def _arrive(name: str) -> None:
    """Tell this iteration's other ranks that this rank reached the point ``name``."""
    ctx = context()
    ctx.store.set(f"{name}/{ctx.rank}", "1")


def _wait_for_peers(name: str, ranks: Iterable[int]) -> None:
    """Return once every rank of ``ranks`` called ``_arrive(name)`` in this iteration."""
    keys = [f"{name}/{r}" for r in ranks]
    _wait_until(lambda: context().store.check(keys), f"ranks {keys} reached {name!r}")


def _peers_of(rank: int) -> list[int]:
    return [r for r in range(context().world_size) if r != rank]


def exception_mid_collective(
    *,
    fail_rank: int,
    steps: int = 5,
    fault_step: int = 2,
    options: dict[str, Any] | None = None,
    record_store_servers: bool = False,
) -> dict[str, Any]:
    """Rank ``fail_rank`` raises at ``fault_step`` of iteration 0 while peers sit in all_reduce.

    ``record_store_servers``: each iteration records the store server processes this rank
    started (``_store_servers``).
    """
    seen: list[dict[str, Any]] = []

    @restartable(**{**FAST, **(options or {})})
    def train() -> dict[str, Any]:
        ctx = context()
        seen.append({"iteration": ctx.iteration, "rank": ctx.rank, "world": ctx.world_size})
        seen[-1]["frozen"] = gc.get_freeze_count()
        if ctx.last_restart is not None:
            seen[-1]["phases"] = dict(ctx.last_restart.phases)
        if record_store_servers:
            seen[-1]["store_servers"] = _store_servers()
        total = 0.0
        for step in range(steps):
            ctx.ping(step=step)
            if ctx.iteration == 0 and step == fault_step:
                if ctx.rank == fail_rank:
                    _wait_for_peers("all_reduce", _peers_of(fail_rank))
                    fi.fire("raise")
                # Nothing but the call is left before this rank blocks in the all_reduce, which
                # cannot complete without fail_rank: the fault finds it there.
                _arrive("all_reduce")
            total = _allreduce_sum(float(ctx.rank + 1))
        return {"sum": total, "iteration": ctx.iteration}

    result = train()
    return {
        "pid": os.getpid(),
        "master_port": int(os.environ["MASTER_PORT"]),
        "seen": seen,
        "result": result,
    }


def _store_servers() -> list[dict[str, Any]]:
    """The ``inprocess.store_server`` processes this process started that are running now:
    pid, argv, session id, and whether the process listens on MASTER_PORT."""
    port = int(os.environ["MASTER_PORT"])
    listening = _listening_socket_inodes(port)
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, ppid = stat.read_text().rsplit(")", 1)[1].split()[:2]
            if int(ppid) != os.getpid() or state == "Z":
                continue
            argv = (stat.parent / "cmdline").read_bytes().decode().split("\0")[:-1]
            if "restartable.inprocess.store_server" not in argv:
                continue
            fds = [os.readlink(fd) for fd in (stat.parent / "fd").iterdir()]
        except OSError:  # exited meanwhile
            continue
        pid = int(stat.parent.name)
        found.append(
            {
                "pid": pid,
                "argv": argv,
                "sid": os.getsid(pid),
                "listens_on_master_port": any(f"socket:[{i}]" in fds for i in listening),
            }
        )
    return found


def _listening_socket_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                local, state, inode = cols[1], cols[3], cols[9]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                    inodes.add(inode)
    return inodes


def fault_with_autograd_off(*, fail_rank: int) -> dict[str, Any]:
    """Rank ``fail_rank`` raises in iteration 0 with autograd switched off, as a ``no_grad``
    block whose ``__exit__`` the restart exception cut short leaves it; the peers wait in an
    all_reduce. Iteration 1 reports whether autograd is on."""

    @restartable(**FAST)
    def train() -> dict[str, Any]:
        ctx = context()
        if ctx.iteration == 0:
            if ctx.rank == fail_rank:
                torch.set_grad_enabled(False)
                raise RuntimeError("fault with autograd off")
            _allreduce_sum(1.0)  # released by the fault
        return {"iteration": ctx.iteration, "grad_enabled": torch.is_grad_enabled()}

    return train()


def hang_then_recover(*, hang_rank: int, steps: int = 4) -> dict[str, Any]:
    """Rank ``hang_rank`` blocks in time.sleep (GIL released) in iteration 0; soft timeout."""
    seen: list[int] = []
    t_fault: list[float] = []
    t_reentry: list[float] = []
    blamed: list[int] = []

    @restartable(**FAST)
    def train() -> dict[str, Any]:
        ctx = context()
        seen.append(ctx.iteration)
        if ctx.iteration == 1:
            t_reentry.append(time.monotonic())
            assert ctx.last_restart is not None
            blamed.extend(ctx.last_restart.faulting_ranks)
        total = 0.0
        for step in range(steps):
            if ctx.rank == hang_rank and ctx.iteration == 0 and step == 1:
                t_fault.append(time.monotonic())
                fi.fire("hang_gil_released")
            total = _allreduce_sum(1.0)
        return {"sum": total}

    t0 = time.monotonic()
    result = train()
    return {
        "pid": os.getpid(),
        "seen": seen,
        "result": result,
        "elapsed": time.monotonic() - t0,
        "hang_interrupted_after": (t_reentry[0] - t_fault[0]) if t_fault else None,
        "blamed": blamed,
    }


def fault_in_finally(*, fail_rank: int) -> dict[str, Any]:
    """Rank ``fail_rank`` raises; every rank's ``finally`` raises again while unwinding."""
    seen: list[int] = []

    @restartable(**FAST)
    def train() -> dict[str, Any]:
        ctx = context()
        seen.append(ctx.iteration)
        try:
            for i in range(3):
                if ctx.iteration == 0 and i == 0:
                    if ctx.rank == fail_rank:  # once the peers are about to block in all_reduce
                        _wait_for_peers("all_reduce", _peers_of(fail_rank))
                        raise ValueError("first fault")
                    _arrive("all_reduce")
                _allreduce_sum(1.0)
        finally:
            if ctx.iteration == 0:
                raise KeyError("cleanup failed while unwinding")
        return {"sum": _allreduce_sum(1.0)}

    return {"pid": os.getpid(), "seen": seen, "result": train()}


def always_fails(
    *, fail_rank: int | None, options: dict[str, Any], vary_step: bool = False
) -> dict[str, Any]:
    """Rank ``fail_rank`` (None: every rank) raises in every iteration; returns the stop
    error's text."""
    from restartable.inprocess import RestartAbortedError

    seen: list[int] = []

    @restartable(**{**FAST, **options})
    def train() -> None:
        ctx = context()
        seen.append(ctx.iteration)
        step = 10 + ctx.iteration if vary_step else 10
        ctx.ping(step=step)
        _allreduce_sum(1.0)
        if fail_rank is None or ctx.rank == fail_rank:
            raise RuntimeError(f"fails at step {step}")
        _allreduce_sum(1.0)

    try:
        train()
    except RestartAbortedError as exc:
        faults = [[f.iteration, f.initial_rank] for f in exc.history]
        return {"seen": seen, "error": str(exc), "history": len(exc.history), "faults": faults}
    return {"seen": seen, "error": None}


def atomic_section(*, fail_rank: int) -> dict[str, Any]:
    """A peer's fault arrives while this rank is inside ``ctx.atomic()``: the block completes."""
    from restartable.checkpoint.sealing import job_sealer
    from restartable.inprocess.protocol import iteration_end, keys
    from restartable.inprocess.protocol.sealed_store import seal

    done: list[int] = []
    seen: list[int] = []

    @restartable(**FAST)
    def train() -> None:
        ctx = context()
        seen.append(ctx.iteration)
        if ctx.iteration == 0:
            if ctx.rank == fail_rank:
                _wait_for_peers("atomic", _peers_of(fail_rank))
                raise RuntimeError("fault while peers are in an atomic section")
            with ctx.atomic():
                _arrive("atomic")
                # Leave only once the restart was requested (the iteration ended with a fault):
                # it must wait for the end of the block.
                root = seal(ctx.store.underlying_store, job_sealer())
                _wait_until(
                    lambda: iteration_end.outcome(root, ctx.iteration) == keys.OUTCOME_FAULT,
                    "the peer's fault ended the iteration",
                )
                done.append(ctx.iteration)
            time.sleep(_SYNC_S)  # the restart lands here
            raise SyncTimeout("no restart was delivered after the atomic section")

    train()
    return {"atomic_completed": done, "iterations": seen}


def _script(mode: str) -> int:
    """Entry point when this file runs as a script under ``inprocess.launch`` (launcher tests)."""
    import signal
    import sys

    rank = int(os.environ["RANK"])
    if mode == "exit_codes":  # rank 1 fails early; rank 0 must not be killed for it
        if rank == 1:
            return 3
        _wait_until(_siblings_exited, "rank 1 exited")
        print("rank 0 finished after its sibling failed", flush=True)
        return 0
    if mode == "killed":  # rank 1 dies by SIGKILL, the others succeed after that
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        _wait_until(_siblings_exited, "rank 1 was killed")
        return 0
    if mode == "signals":
        got = []
        signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
        print("ready", flush=True)
        deadline = time.monotonic() + 20
        while not got and time.monotonic() < deadline:
            time.sleep(0.05)
        print("got SIGTERM" if got else "no signal", flush=True)
        return 0 if got else 5
    if mode == "restart":  # the core through the launcher: one exception, one restart
        result = exception_mid_collective(fail_rank=1, steps=3, fault_step=1)
        print(f"iterations {[s['iteration'] for s in result['seen']]}", flush=True)
        return 0
    if mode == "orphan":  # ranks that would run for a minute; the test kills the launcher

        @restartable(**FAST)
        def train() -> None:
            print(f"pid {os.getpid()} ready", flush=True)
            for _ in range(600):  # the workload, not a head start: the test kills the launcher
                time.sleep(0.1)

        train()
        return 0
    print(f"unknown mode {mode}", file=sys.stderr)
    return 2


def _siblings_exited() -> bool:
    """Whether every other rank of our launcher exited (its children but us are zombies or gone:
    the launcher reaps its ranks in order, rank 0 first)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, ppid = stat.read_text().rsplit(")", 1)[1].split()[:2]
        except OSError:  # exited meanwhile
            continue
        if int(ppid) == os.getppid() and int(stat.parent.name) != os.getpid() and state != "Z":
            return False
    return True


if __name__ == "__main__":
    import sys

    sys.exit(_script(sys.argv[1]))


def restart_during_persistent_save(*, root: str, delay: float) -> dict[str, Any]:
    """A manager that outlives train(); every rank raises right after the background save of
    step 2 started, so the restart lands while the writers coordinate the save."""
    from restartable.checkpoint import CheckpointManager

    iterations: list[dict[str, Any]] = []
    mgr = CheckpointManager(root, persistent_every=1, keep=3, local_every=1, timeout=60.0)

    @restartable(**FAST)
    def train() -> None:
        ctx = context()
        state = {"w": torch.zeros(2**18), **{f"b{i}": torch.zeros(64) for i in range(100)}}
        t0 = time.monotonic()
        loaded = mgr.load_latest(state)
        iterations.append(
            {
                "loaded": loaded,
                "load_s": time.monotonic() - t0,
                "value": float(state["w"][0]),
                "cause": ctx.last_restart.cause if ctx.last_restart else None,
            }
        )
        for step in range((loaded or 0) + 1, 4):
            ctx.ping(step=step)
            state["w"].fill_(float(step))
            mgr.save(step, state)
            if step == 1:
                mgr.wait()  # step 1 is committed before the fault
            if step == 2 and ctx.iteration == 0:
                # Not a head start: the delay is the scenario's parameter, where in the save
                # the restart lands (0: before any exchange); every placement must end the same.
                time.sleep(delay)
                fi.fire("raise", detail="restart during a persistent save")
        mgr.wait()

    train()
    committed = [c.step for c in mgr.committed()]
    mgr.close()
    return {"iterations": iterations, "committed": committed}
