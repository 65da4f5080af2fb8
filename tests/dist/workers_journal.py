"""A small restartable job (not the example) for the journal and report tests."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from restartable.checkpoint import CheckpointManager
from restartable.inprocess import context, restartable
from restartable.inprocess import faults as fi

STEPS = 40
FAULT_STEP = 15


def job(*, root: str, record_dir: str, ping: bool = True, step_s: float = 0.01) -> dict[str, Any]:
    """40 steps of ``step_s`` with an all_reduce each; rank 1 raises at step 15 once. Returns this
    process's own clock readings: when train() was called and returned, and rank 0's steps.
    ``ping=False``: a script that never calls ``ctx.ping`` and saves no checkpoint."""
    mgr = CheckpointManager(root, persistent_every=20, local_every=1)
    reached: list[tuple[float, int]] = []

    @restartable(backend="gloo", soft_timeout=2.0, hard_timeout=6.0, heartbeat_interval=0.5)
    def train() -> int:
        ctx = context()
        state = {"w": torch.zeros(4)}
        start = mgr.load_latest(state) or 0
        for step in range(start, STEPS):
            if ping:
                ctx.ping(step)
            if ctx.rank == 0:
                reached.append((time.time(), step))
            fi.inject(
                "exception", rank=1, step=FAULT_STEP, current_step=step, record_dir=record_dir
            )
            time.sleep(step_s)
            x = torch.ones(4)
            dist.all_reduce(x)
            state["w"] += x
            if ping:
                mgr.save(step + 1, state)
        mgr.wait()
        return int(state["w"][0].item())

    t0 = time.time()
    value = train()
    t1 = time.time()
    mgr.close()
    return {"value": value, "t_call": t0, "t_return": t1, "reached": reached}
