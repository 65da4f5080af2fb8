"""Rank functions for the etcd store tests (run through tests.multiproc.run_ranks).

The ``@restartable`` jobs select the etcd store the way a user does: ``INPROCESS_STORE`` (the
cluster) and ``INPROCESS_JOB_ID`` (the job's key namespace) in the environment, which the
wrapper, its monitors and each rank's watchdog process all read (docs/etcd.md). The plain c10d
test opens an ``EtcdStore`` itself from the same variables.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

_HANDSHAKE_S = 20.0  # bound of the wait for the test to kill the etcd leader
# The restart config of the job: the tests' fast timeouts, but a soft timeout above the stall
# that losing the etcd leader causes (an election: ~1-2 s with election-timeout 1 s on a loaded
# machine), during which a store call of the main thread makes no progress (docs/etcd.md).
ETCD_OPTIONS: dict[str, Any] = {"soft_timeout": 5.0, "hard_timeout": 12.0, "active_world_size": 2}


def _options(**overrides: Any) -> dict[str, Any]:
    from tests.dist.workers_inprocess import FAST

    return {**FAST, **ETCD_OPTIONS, **overrides}


# ----- plain c10d over the store -------------------------------------------------------------


def gloo_all_reduce() -> dict[str, Any]:
    """``init_process_group`` over an ``EtcdStore`` (through a ``PrefixStore``), one all_reduce."""
    import torch
    import torch.distributed as dist

    from restartable.inprocess.etcd import EtcdStore

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = EtcdStore(
        os.environ["INPROCESS_STORE"], prefix=os.environ["INPROCESS_JOB_ID"], timeout=30
    )
    t0 = time.monotonic()
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=world
    )
    init_s = time.monotonic() - t0
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    dist.barrier()
    dist.destroy_process_group()
    return {"sum": float(t.item()), "init_s": init_s}


# ----- a @restartable job --------------------------------------------------------------------

DIM = 4
LR = 0.1


def batch(step: int, rank: int) -> tuple[Any, Any]:
    """The data of ``rank`` (0..active-1) at ``step``: the same whichever process runs it."""
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, DIM, generator=g)
    return x, x @ torch.arange(1.0, DIM + 1)


def reference_loss(steps: int, active: int) -> float:
    """The final loss of the same training without any fault, computed in one process."""
    import torch

    w = torch.zeros(DIM)
    for step in range(steps):
        grad = torch.zeros(DIM)
        for r in range(active):
            wr = w.clone().requires_grad_(True)
            x, y = batch(step, r)
            ((x @ wr - y) ** 2).mean().backward()
            assert wr.grad is not None
            grad += wr.grad
        w = w - LR * grad / active
    losses = [float(((x @ w - y) ** 2).mean()) for x, y in (batch(steps, r) for r in range(active))]
    return sum(losses) / active


def restartable_job(
    *, steps: int, exception_at: int, kill_at: int, leader_at: int | None
) -> dict[str, Any]:
    """Data-parallel training of a linear model on 2 active ranks + 1 reserve over etcd.

    Faults: rank 1 raises at step ``exception_at`` (iteration 0); rank 0 SIGKILLs itself at
    ``kill_at`` (iteration 1); at ``leader_at`` (iteration 2; None: never) rank 0 asks the test
    to kill the etcd leader (file ``kill-leader`` in TEST_RESULT_DIR) and waits until it did
    (``leader-killed``). The state
    lives in this process across restarts; after a restart the rank with the newest step
    broadcasts it (a reserve starts empty).
    """
    import signal

    import torch
    import torch.distributed as dist

    from restartable.inprocess import context, restartable

    state: dict[str, Any] = {"step": 0, "w": torch.zeros(DIM)}
    seen: list[dict[str, Any]] = []

    @restartable(**_options())
    def train() -> float:
        ctx = context()
        seen.append({"iteration": ctx.iteration, "rank": ctx.rank, "from": state["step"]})
        _sync_state(state)
        w = state["w"]
        for step in range(state["step"], steps):
            ctx.ping(step=step)
            if ctx.iteration == 0 and step == exception_at and ctx.rank == 1:
                raise RuntimeError("injected exception")
            if ctx.iteration == 1 and step == kill_at and ctx.rank == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            if ctx.iteration == 2 and step == leader_at and ctx.rank == 0:
                results = Path(os.environ["TEST_RESULT_DIR"])
                (results / "kill-leader").touch()
                deadline = time.monotonic() + _HANDSHAKE_S
                while not (results / "leader-killed").exists():
                    if time.monotonic() > deadline:
                        raise TimeoutError("the test did not kill the etcd leader")
                    time.sleep(0.01)
                    ctx.ping(step=step)
            wr = w.clone().requires_grad_(True)
            x, y = batch(step, ctx.rank)
            ((x @ wr - y) ** 2).mean().backward()
            assert wr.grad is not None
            grad = wr.grad
            dist.all_reduce(grad)
            w = w - LR * grad / ctx.world_size
            state["w"], state["step"] = w, step + 1
        x, y = batch(steps, ctx.rank)
        loss = ((x @ w - y) ** 2).mean().reshape(1)
        dist.all_reduce(loss)
        return float(loss.item()) / ctx.world_size

    result = train()
    return {"pid": os.getpid(), "loss": result, "seen": seen}


def _sync_state(state: dict[str, Any]) -> None:
    """Every active rank adopts the state of the rank that got furthest."""
    import torch
    import torch.distributed as dist

    step = torch.tensor([state["step"]])
    dist.all_reduce(step, op=dist.ReduceOp.MAX)
    mine = torch.tensor([dist.get_rank() if state["step"] == int(step) else 1 << 30])
    dist.all_reduce(mine, op=dist.ReduceOp.MIN)
    w = state["w"].clone()
    dist.broadcast(w, src=int(mine))
    state["w"], state["step"] = w, int(step)


# ----- benchmark (benchmarks/store_etcd.py) --------------------------------------------------


def bench_restarts(*, trials: int, gap: int, timed_steps: int, use_etcd: bool) -> dict[str, Any]:
    """``trials`` exception restarts (rank 1 raises every ``gap`` steps), then ``timed_steps``
    steps without faults. Returns, per trial, the fault time (on the faulting rank) and when
    this rank finished the first all_reduce of the next iteration, and the mean step time.
    ``use_etcd``: the caller set INPROCESS_STORE / INPROCESS_JOB_ID (kept for the record)."""
    del use_etcd
    import torch
    import torch.distributed as dist

    from restartable.inprocess import context, restartable

    state: dict[str, Any] = {"step": 0}
    faults: dict[int, float] = {}  # iteration -> wall time just before the raise
    resumed: dict[int, float] = {}  # iteration -> first all_reduce done
    step_s: list[float] = []

    @restartable(**_options(active_world_size=None))
    def train() -> None:
        ctx = context()
        # A peer may have completed the all_reduce that failed here: resume from the newest step.
        step_t = torch.tensor([state["step"]])
        dist.all_reduce(step_t, op=dist.ReduceOp.MAX)
        state["step"] = int(step_t)
        t = torch.ones(1)
        total = trials * gap + timed_steps
        while state["step"] < total:
            step = state["step"]
            ctx.ping(step=step)
            trial = step // gap  # the trial that faults at this step (iteration trial - 1)
            if ctx.rank == 1 and step % gap == 0 and trial == ctx.iteration + 1 <= trials:
                faults[ctx.iteration] = time.time()
                raise RuntimeError("benchmark fault")
            t0 = time.perf_counter()
            dist.all_reduce(t)
            if ctx.iteration not in resumed:
                resumed[ctx.iteration] = time.time()
            if step >= trials * gap:
                step_s.append(time.perf_counter() - t0)
            state["step"] = step + 1

    train()
    return {"faults": faults, "resumed": resumed, "step_s": step_s}


# ----- a script for inprocess.launch --store ------------------------------------------------


def _script(mode: str) -> int:
    """``python tests/dist/workers_etcd.py launch``: ``restartable_job`` through an exception
    (iteration 0) and a SIGKILLed rank (iteration 1); prints the loss on the active ranks and
    how many keys the job holds in its etcd namespace (0 would mean it did not use etcd)."""
    if mode != "launch":
        print(f"unknown mode {mode}", file=sys.stderr)
        return 2
    from restartable.inprocess.etcd import EtcdStore

    result = restartable_job(steps=10, exception_at=2, kill_at=5, leader_at=None)
    if result["loss"] is not None:
        print(f"loss {result['loss']!r}", flush=True)
    job = os.environ["INPROCESS_JOB_ID"]
    with EtcdStore(os.environ["INPROCESS_STORE"], prefix=job, timeout=30) as store:
        print(f"etcd keys of {job}: {store.num_keys()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_script(sys.argv[1]))
