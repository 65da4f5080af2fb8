"""Rank functions for the section-timeout tests (run through tests.multiproc.run_ranks)."""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist

from restartable.inprocess import context, restartable
from restartable.inprocess import faults as fi

# soft_timeout stays at 2 s: a hang caught well before it was caught by the section timeout.
OPTIONS = {
    "backend": "gloo",  # CPU tensors, also on a host with a GPU (the default is nccl there)
    "soft_timeout": 2.0,
    "hard_timeout": 6.0,
    "heartbeat_interval": 0.5,
    "barrier_timeout": 30.0,
    "completion_timeout": 30.0,
    "calculate_timeouts": True,
    "rank_section_timeouts": {"step": 30.0},
}
STEP_S = 0.02  # each step's own work besides its all_reduce


def sectioned_job(
    *,
    state_path: str,
    steps: int,
    hang_rank: int | None = None,
    hang_step: int | None = None,
    slow_first_step: float = 0.0,
) -> dict[str, Any]:
    """``steps`` steps in a ``step`` section each (after a ``setup`` section).

    Rank ``hang_rank`` hangs (GIL released) inside the step section of step ``hang_step`` of
    iteration 0. Every rank's first step of iteration 1 (after the restart) sleeps
    ``slow_first_step`` x its step timeout at the time of the hang (at most 1.5 s, below the
    soft timeout) inside its step section: slow but healthy.
    """
    seen: list[int] = []
    causes: list[str] = []
    blamed: list[int] = []
    t_fault: list[float] = []
    t_reentry: list[float] = []
    limits_at_hang: dict[str, Any] = {}
    limits_after: dict[str, Any] = {}
    slept: list[float] = []

    @restartable(**OPTIONS, timeouts_state_path=state_path)
    def train() -> float:
        ctx = context()
        seen.append(ctx.iteration)
        if ctx.last_restart is not None:
            t_reentry.append(time.monotonic())
            causes.append(ctx.last_restart.cause)
            blamed.extend(ctx.last_restart.faulting_ranks)
        with ctx.section("setup"):
            t = torch.ones(1)
            dist.all_reduce(t)
        total = 0.0
        for step in range(steps):
            with ctx.section("step"):
                if ctx.iteration == 0 and step == hang_step:
                    limits_at_hang.update(ctx.section_timeouts())
                    if ctx.rank == hang_rank:
                        t_fault.append(time.monotonic())
                        fi.fire("hang_gil_released")
                if ctx.iteration == 1 and step == 0 and slow_first_step:
                    slept.append(min(1.5, slow_first_step * limits_at_hang["step"][0]))
                    time.sleep(slept[0])
                t = torch.ones(1)
                dist.all_reduce(t)
                total += float(t.item())
                time.sleep(STEP_S)
        limits_after.update(ctx.section_timeouts())
        return total

    result = train()
    return {
        "pid": os.getpid(),
        "seen": seen,
        "result": result,
        "causes": causes,
        "blamed": blamed,
        "hang_interrupted_after": (t_reentry[0] - t_fault[0]) if t_fault and t_reentry else None,
        "limits_at_hang": limits_at_hang,
        "limits_after": limits_after,
        "slept": slept,
    }
