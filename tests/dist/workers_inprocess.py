"""Rank functions for the in-process restart tests (run through tests.multiproc.run_ranks)."""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist

from inprocess import context, restartable
from inprocess import faults as fi

FAST = {"soft_timeout": 2.0, "hard_timeout": 6.0, "heartbeat_interval": 0.5,
        "barrier_timeout": 30.0, "completion_timeout": 30.0}


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
