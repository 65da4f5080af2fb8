"""The rank script of ``benchmarks/sealing_cost.py --job``: real in-process restarts, timed.

    python -m restartable.launch --nproc-per-node 2 benchmarks/sealing_cost_job.py FAULTS

Every ``Sealer.seal`` / ``Sealer.open`` of this process is timed (all threads: the main
thread's protocol, the monitors, the checkpoint exchange). Rank 0 raises once in each of the
first FAULTS iterations, each at another step (a repeat at the same place would be an
application fault); at the first all_reduce after each restart it prints one line
``BENCH {"restart_s", "sealing_s", "calls"}``: from just before the raise to the end of that
all_reduce (``restart_latency.py``'s definition), and what sealing took of it in this process.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from restartable.checkpoint import sealing
from restartable.inprocess import context, restartable

_lock = threading.Lock()
_spent = [0.0, 0]  # seconds inside seal/open, calls


def _timed(fn: Callable[..., Any]) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            with _lock:
                _spent[0] += time.perf_counter() - t0
                _spent[1] += 1

    return timed


sealing.Sealer.seal = _timed(sealing.Sealer.seal)  # type: ignore[method-assign]
sealing.Sealer.open = _timed(sealing.Sealer.open)  # type: ignore[method-assign]


def main(faults: int) -> int:
    rank = int(os.environ["RANK"])
    mark: list[tuple[float, float, int]] = []  # (perf_counter, sealing s, calls) at the raise

    @restartable(backend="gloo", soft_timeout=60.0, hard_timeout=120.0, max_iterations=faults + 2)
    def train() -> None:
        ctx = context()
        for step in range(1, faults + 4):
            ctx.ping(step=step)
            dist.all_reduce(torch.ones(1))
            if rank == 0 and step == 1 and mark:
                t0, s0, c0 = mark.pop()
                with _lock:
                    sealing_s, calls = _spent[0] - s0, _spent[1] - c0
                restart_s = time.perf_counter() - t0
                print("BENCH " + json.dumps({"restart_s": restart_s, "sealing_s": sealing_s,
                                             "calls": calls}), flush=True)  # fmt: skip
            if rank == 0 and ctx.iteration < faults and step == 2 + ctx.iteration:
                with _lock:
                    mark.append((time.perf_counter(), _spent[0], _spent[1]))
                raise RuntimeError(f"benchmark fault {ctx.iteration}")

    train()
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
