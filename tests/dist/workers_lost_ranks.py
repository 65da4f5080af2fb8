"""Rank functions for the lost-ranks tests: a small all_reduce loop under ``@restartable`` that
loses ranks on cue (``inprocess.faults``: kill, GIL-held hang, exception; a failing health check).

Every call of ``train()`` appends one JSON line to ``<calls_dir>/calls.<initial rank>.jsonl``
before its first step, so the test sees which ranks were active in each iteration even for ranks
that were killed later; every fault that fired is recorded in ``calls_dir`` (``faults.fired``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

STEPS = 4


def _initial_rank() -> int:
    return int(os.environ["RANK"])


def _log_call(ctx: Any, calls_dir: str) -> None:
    line = {
        "iteration": ctx.iteration,
        "rank": ctx.rank,
        "world_size": ctx.world_size,
        "initial_rank": ctx.initial_rank,
        "pid": os.getpid(),
    }
    path = Path(calls_dir) / f"calls.{ctx.initial_rank}.jsonl"
    with path.open("a") as f:
        f.write(json.dumps(line) + "\n")


def train_with_faults(
    *,
    config: dict[str, Any],
    faults: list[dict[str, Any]],
    calls_dir: str,
    unhealthy_after_iteration: dict[str, int] | None = None,
) -> dict[str, Any]:
    """Run STEPS all_reduce steps under @restartable(**config); inject ``faults``.

    ``faults``: ``{"kind": k, "rank": r, "iteration": i, "step": s}``: fault kind ``k`` of
    ``inprocess.faults`` on training rank ``r`` (``ctx.rank``) at step ``s`` of iteration ``i``.
    ``unhealthy_after_iteration``: ``{initial rank (str): i}`` makes a user health check fail on
    that rank once it ran ``train()`` in iteration ``i`` or later.
    """
    import logging

    import torch
    import torch.distributed as dist

    from restartable.inprocess import faults as fi
    from restartable.inprocess import restartable
    from restartable.inprocess.context import context

    # The restart records (INFO, with per-phase timings) end up in the rank's output.
    logging.basicConfig(level=logging.INFO, format="%(relativeCreated)d %(name)s: %(message)s")
    me = _initial_rank()
    ran: list[int] = []
    sick_from = (unhealthy_after_iteration or {}).get(str(me))

    def health() -> None:
        if sick_from is not None and any(i >= sick_from for i in ran):
            raise RuntimeError(f"simulated bad GPU on initial rank {me}")

    # CPU tensors: gloo, also on a host with a GPU (the default is nccl there).
    @restartable(**{"backend": "gloo", **config}, health_checks=(health,))
    def train() -> dict[str, Any]:
        ctx = context()
        ran.append(ctx.iteration)
        _log_call(ctx, calls_dir)
        total = 0.0
        for step in range(STEPS):
            for f in faults:
                fi.inject(**f, current_step=step, record_dir=calls_dir)
            t = torch.ones(1)
            dist.all_reduce(t)
            total += t.item()
        return {
            "iteration": ctx.iteration,
            "rank": ctx.rank,
            "world_size": ctx.world_size,
            "initial_rank": ctx.initial_rank,
            "sum": total,
        }

    result = train()
    return {"initial_rank": me, "pid": os.getpid(), "result": result}


# as a script under `python -m restartable.launch`: argv[1] = kwargs JSON
if __name__ == "__main__":
    import sys

    train_with_faults(**json.loads(sys.argv[1]))
