"""A torchrun-style script under ``python -m restartable.launch``
(tests/dist/test_torchrun_script.py).

    python -m restartable.launch --nproc-per-node 3 tests/dist/workers_torchrun.py MODE

Modes: ``env`` (rank 0's process is SIGKILLed in iteration 0; every iteration prints the
torchrun variables and writes the `if LOCAL_RANK == 0` snapshot), ``own_init`` (the script
calls init_process_group itself before train()), ``raise`` (rank 1 raises once from a nested
function: its traceback must be logged once).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from restartable.inprocess import context, restartable

FAST = {
    "backend": "gloo",
    "soft_timeout": 2.0,
    "hard_timeout": 6.0,
    "heartbeat_interval": 0.5,
    "barrier_timeout": 30.0,
    "completion_timeout": 30.0,
    "active_world_size": 2,
}
VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")


def env_mode(out: Path) -> None:
    @restartable(**FAST)
    def train() -> None:
        ctx = context()
        seen = " ".join(f"{k}={os.environ[k]}" for k in VARS)
        print(f"iteration {ctx.iteration} rank {ctx.rank}/{ctx.world_size}: {seen}", flush=True)
        if int(os.environ["LOCAL_RANK"]) == 0:  # the DDP tutorial's snapshot writer
            (out / f"snapshot-{ctx.iteration}").write_text(str(ctx.initial_rank))
        t = torch.ones(1)
        dist.all_reduce(t)
        if ctx.iteration == 0 and ctx.rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(t)
        time.sleep(0.2 if ctx.iteration == 0 else 0.0)  # the peer's death reaches it here

    train()


def own_init_mode() -> None:
    dist.init_process_group("gloo")  # torchrun's pattern, which @restartable does for you

    @restartable(**FAST)
    def train() -> None:
        pass

    train()


def _inner_failure() -> None:
    raise ValueError("bad batch shape (3, 5)")


def raise_mode() -> None:
    @restartable(**FAST)
    def train() -> None:
        ctx = context()
        if ctx.iteration == 0 and ctx.rank == 1:
            _inner_failure()
        t = torch.ones(1)
        dist.all_reduce(t)

    train()


def readme_mode(ckpt: str) -> None:
    """The README-style script (manager outside train(), DDP module in the state) with the
    cyclic GC off in train(), as if it happened not to run: rank 1 raises at steps 5, 10, ..., 25
    while rank 0 waits on it in DDP's all-reduce; the framework's line says how long each restart
    took."""
    import gc

    from restartable.checkpoint import CheckpointManager

    mgr = CheckpointManager(ckpt, local_every=1, persistent_every=1000)

    @restartable(**{**FAST, "soft_timeout": 4.0, "hard_timeout": 10.0, "active_world_size": None})
    def train() -> None:
        gc.disable()  # after freeze_gc, which froze the start-up's objects
        ctx = context()
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        state = {"model": model, "opt": opt}
        start = mgr.load_latest(state) or 0
        for step in range(start + 1, 28):
            ctx.ping(step=step)
            if ctx.rank == 1 and step == 5 * (ctx.iteration + 1):
                raise RuntimeError(f"fault at step {step}")
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            mgr.save(step, state)

    train()
    mgr.close()


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "env":
        env_mode(Path(sys.argv[2]))
    elif mode == "own_init":
        own_init_mode()
    elif mode == "raise":
        raise_mode()
    elif mode == "readme":
        readme_mode(sys.argv[2])
    else:
        sys.exit(f"unknown mode {mode}")
