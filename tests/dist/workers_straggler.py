"""Rank functions for the straggler tests (``tests/dist/test_straggler.py``).

``ddp_job``: a small DDP model on CPU/gloo under ``@restartable`` with a ``straggler.Detector``;
a planned ``slow`` fault (``inprocess.faults``) makes one rank's compute slower from a step on.
``store_job``: no ``@restartable`` and no process group: the detector gathers through the job's
TCPStore only; one rank may die, one may be slow, ``stop_if_detected`` may stop the others.
Each returns what the test asserts: step wall times, reports, restarts.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

# Sized so that a step is ~10-20 ms of CPU on one core: compute, not Python overhead, dominates.
FEATURES = 384
BATCH = 192


def _report_summary(report: Any) -> dict[str, Any]:
    return {
        "round": report.round,
        "step": report.step,
        "stragglers": sorted(report.stragglers),
        "relative": {str(r): s for r, s in report.relative.items()},
        "individual": {str(r): s for r, s in report.individual.items()},
        "demote": report.demote,
        "stop": report.stop,
        "missing": list(report.missing),
    }


def ddp_job(
    *,
    config: dict[str, Any],
    detector: dict[str, Any],
    plan: str,
    steps: int,
    record_dir: str,
    until: tuple[int, int, int],
    factor: float | None = None,
) -> dict[str, Any]:
    """Train ``steps`` steps of DDP under ``@restartable(**config)`` with
    ``Detector(context=ctx, **detector)``. ``plan``: an ``inprocess.faults`` plan (``slow@...``);
    the slow rank's compute takes ``factor`` (None: ``faults.SLOW_FACTOR``) times as long.
    ``until=(iteration, step, n)``: stop once ``n`` reports of that iteration were made at or
    after ``step`` (reports are time-based: the test must not depend on the machine's speed;
    every rank sees the same reports, so all stop at the same step); ``steps`` is only a cap.
    Returns this process's step records ``[iteration, ctx.rank, step, wall seconds]``, its
    reports (also per iteration: ``reports_by_iteration``) and the restarts it saw."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from restartable.inprocess import context, restartable
    from restartable.inprocess import faults as fi
    from restartable.straggler import Detector

    logging.basicConfig(level=logging.INFO, format="%(relativeCreated)d %(name)s: %(message)s")
    torch.set_num_threads(1)
    planned = fi.parse_plan(plan, steps=steps)
    seen: dict[str, Any] = {"steps": [], "reports": [], "restarts": []}

    # CPU tensors: gloo, also on a host with a GPU (the default is nccl there).
    @restartable(**{"backend": "gloo", **config})
    def train() -> int:
        ctx = context()
        if ctx.last_restart is not None:
            seen["restarts"].append(ctx.last_restart.cause)
        reports: list[dict[str, Any]] = []  # this iteration's
        # on_report: the report that demotes a rank is never returned (the restart interrupts).
        det = Detector(
            context=ctx, on_report=lambda r: reports.append(_report_summary(r)), **detector
        )
        seen["reports"].append(reports)
        torch.manual_seed(0)
        model = DDP(torch.nn.Sequential(torch.nn.Linear(FEATURES, FEATURES), torch.nn.Tanh()))
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        x = torch.randn(BATCH, FEATURES)
        # Where to resume: the furthest step any rank reached (a reserve starts at 0), as a
        # checkpoint restore would say.
        start = torch.tensor([seen.get("next", 0)])
        dist.all_reduce(start, op=dist.ReduceOp.MAX)
        slow = fi.slowdown(record_dir)
        for step in range(int(start), steps):
            ctx.ping(step)
            t0 = time.perf_counter()
            if any(f.step == step for f in planned):
                fi.fire_planned(planned, step=step, record_dir=record_dir)
                slow = fi.slowdown(record_dir)
            with det.section("step"):
                c0 = time.process_time()
                opt.zero_grad()
                model(x).square().mean().backward()
                opt.step()
                if slow > 1:
                    fi.burn(((factor or slow) - 1) * (time.process_time() - c0))
            det.report_if_due(step)
            seen["steps"].append([ctx.iteration, ctx.rank, step, time.perf_counter() - t0])
            seen["next"] = step + 1
            if (
                ctx.iteration == until[0]
                and sum(r["step"] >= until[1] for r in reports) >= until[2]
            ):
                break
        return steps

    train()
    seen["reports_by_iteration"] = seen["reports"]
    seen["reports"] = [r for per_iteration in seen["reports"] for r in per_iteration]
    return {k: v for k, v in seen.items() if k != "next"}


def store_job(
    *,
    detector: dict[str, Any],
    steps: int,
    step_s: float,
    slow_rank: int | None = None,
    die_rank: int | None = None,
    die_at: int = 0,
) -> dict[str, Any]:
    """Steps of ``step_s`` CPU seconds each, timed by a detector that gathers through the job's
    TCPStore (MASTER_ADDR/PORT), without ``@restartable`` or a process group. ``slow_rank``
    burns twice as long; ``die_rank`` exits at step ``die_at`` without a word. Stops when the
    detector says so. Returns the steps done, the reports and whether it stopped."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    from restartable.inprocess import faults as fi
    from restartable.straggler import Detector

    logging.basicConfig(level=logging.INFO, format="%(relativeCreated)d %(name)s: %(message)s")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=30),
    )
    det = Detector(store=store, rank=rank, world_size=world, timer="cpu", **detector)
    reports = []
    done = 0
    t0 = time.monotonic()
    for step in range(steps):
        if rank == die_rank and step == die_at:
            os._exit(3)
        with det.section("step"):
            fi.burn(step_s * (2.0 if rank == slow_rank else 1.0))
        report = det.report_if_due(step)
        if report is not None:
            reports.append(_report_summary(report))
        done = step + 1
        if det.should_stop:
            break
    return {
        "done": done,
        "stopped": det.should_stop,
        "reports": reports,
        "seconds": time.monotonic() - t0,
    }
