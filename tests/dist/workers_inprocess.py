"""Rank functions for the in-process restart tests (run through tests.multiproc.run_ranks)."""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist

from inprocess import context, restartable
from inprocess import faults as fi

FAST = {
    "soft_timeout": 2.0,
    "hard_timeout": 6.0,
    "heartbeat_interval": 0.5,
    "barrier_timeout": 30.0,
    "completion_timeout": 30.0,
}


def _allreduce_sum(value: float) -> float:
    t = torch.tensor([value])
    dist.all_reduce(t)
    return float(t.item())


def exception_mid_collective(
    *, fail_rank: int, steps: int = 5, fault_step: int = 2, options: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Rank ``fail_rank`` raises at ``fault_step`` of iteration 0 while peers sit in all_reduce."""
    seen: list[dict[str, Any]] = []

    @restartable(**{**FAST, **(options or {})})
    def train() -> dict[str, Any]:
        ctx = context()
        seen.append({"iteration": ctx.iteration, "rank": ctx.rank, "world": ctx.world_size})
        if ctx.last_restart is not None:
            seen[-1]["phases"] = dict(ctx.last_restart.phases)
        total = 0.0
        for step in range(steps):
            ctx.ping(step=step)
            if ctx.rank == fail_rank and ctx.iteration == 0 and step == fault_step:
                time.sleep(0.2)  # peers are inside the all_reduce by now
                fi.fire("raise")
            total = _allreduce_sum(float(ctx.rank + 1))
        return {"sum": total, "iteration": ctx.iteration}

    result = train()
    return {"pid": os.getpid(), "seen": seen, "result": result}


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
            for _ in range(3):
                if ctx.rank == fail_rank and ctx.iteration == 0:
                    time.sleep(0.1)
                    raise ValueError("first fault")
                _allreduce_sum(1.0)
        finally:
            if ctx.iteration == 0:
                raise KeyError("cleanup failed while unwinding")
        return {"sum": _allreduce_sum(1.0)}

    return {"pid": os.getpid(), "seen": seen, "result": train()}


def always_fails(
    *, fail_rank: int, options: dict[str, Any], vary_step: bool = False
) -> dict[str, Any]:
    """Rank ``fail_rank`` raises in every iteration; returns the stop error's text."""
    from inprocess import RestartAbortedError

    seen: list[int] = []

    @restartable(**{**FAST, **options})
    def train() -> None:
        ctx = context()
        seen.append(ctx.iteration)
        step = 10 + ctx.iteration if vary_step else 10
        ctx.ping(step=step)
        _allreduce_sum(1.0)
        if ctx.rank == fail_rank:
            raise RuntimeError(f"fails at step {step}")
        _allreduce_sum(1.0)

    try:
        train()
    except RestartAbortedError as exc:
        return {"seen": seen, "error": str(exc), "history": len(exc.history)}
    return {"seen": seen, "error": None}


def atomic_section(*, fail_rank: int) -> dict[str, Any]:
    """A peer's fault arrives while this rank is inside ``ctx.atomic()``: the block completes."""
    done: list[int] = []

    @restartable(**FAST)
    def train() -> None:
        ctx = context()
        if ctx.iteration == 0:
            if ctx.rank == fail_rank:
                time.sleep(0.2)
                raise RuntimeError("fault while peers are in an atomic section")
            with ctx.atomic():
                time.sleep(1.0)  # the restart arrives meanwhile and must wait
                done.append(ctx.iteration)
            time.sleep(5)  # interrupted here

    train()
    return {"atomic_completed": done}


def _script(mode: str) -> int:
    """Entry point when this file runs as a script under ``inprocess.launch`` (launcher tests)."""
    import signal
    import sys

    rank = int(os.environ["RANK"])
    if mode == "exit_codes":  # rank 1 fails early; rank 0 must not be killed for it
        if rank == 1:
            return 3
        time.sleep(1.0)
        print("rank 0 finished after its sibling failed", flush=True)
        return 0
    if mode == "killed":  # rank 1 dies by SIGKILL, the others succeed
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.5)
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
            for _ in range(600):
                time.sleep(0.1)

        train()
        return 0
    print(f"unknown mode {mode}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    import sys

    sys.exit(_script(sys.argv[1]))


def restart_during_persistent_save(*, root: str, delay: float) -> dict[str, Any]:
    """A manager that outlives train(); every rank raises right after the background save of
    step 2 started, so the restart lands while the writers coordinate the save."""
    from checkpoint import CheckpointManager

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
                time.sleep(delay)  # the writers are past their first exchange by now
                fi.fire("raise", detail="restart during a persistent save")
        mgr.wait()

    train()
    committed = [c.step for c in mgr.committed()]
    mgr.close()
    return {"iterations": iterations, "committed": committed}
