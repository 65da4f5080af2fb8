"""A DDP script whose rank 0 is SIGKILLed while a reserve waits (tests/dist/test_warm_reserve.py).

    python -m restartable.launch --nproc-per-node 3 tests/dist/workers_warm.py

Every iteration prints, per rank, whether ``torch._dynamo`` (what the first ``DDP(...)``
imports) was imported before its ``DDP(...)`` and how long that took. Rank 0 trains for
``--train-s`` seconds of iteration 0 and until the reserve's warm-up ended (its prewarm, which
runs after the first-use imports, touches ``--warm-marker``), then SIGKILLs itself.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from restartable.inprocess import context, restartable

p = argparse.ArgumentParser()
p.add_argument("--train-s", type=float, default=6.0)
p.add_argument("--warm-marker", required=True)
args = p.parse_args()
marker = Path(args.warm_marker)


# soft_timeout 20 s: gloo's timeout is 1.25 x soft_timeout, and the active ranks' first DDP()
# imports torch._dynamo before its broadcast (5.9 s on a loaded machine): with 5 s, the faster
# rank timed out waiting for the slower one, iteration 0 ended without the kill, and no reserve
# ever took a place (CI: no "iteration 1 initial rank 2" line).
@restartable(
    backend="gloo",
    soft_timeout=20.0,
    hard_timeout=40.0,
    barrier_timeout=60.0,
    completion_timeout=60.0,
    active_world_size=2,
    prewarm=marker.touch,
)
def train() -> None:
    ctx = context()
    imported = "torch._dynamo" in sys.modules
    t0 = time.perf_counter()
    model = DDP(torch.nn.Linear(8, 8))
    ddp_s = time.perf_counter() - t0
    print(
        f"iteration {ctx.iteration} initial rank {ctx.initial_rank}: torch._dynamo imported "
        f"before DDP: {imported}; DDP() took {ddp_s:.3f} s",
        flush=True,
    )
    end = time.monotonic() + args.train_s
    for step in range(1, 1_000_000):
        model(torch.randn(4, 8)).sum().backward()
        ctx.ping(step)
        if ctx.iteration > 0 or time.monotonic() > end:
            break
        time.sleep(0.05)
    if ctx.iteration == 0 and ctx.rank == 0:
        # What the test checks is a reserve that finished warming up: on a loaded machine its
        # low-priority imports can take longer than the training (the wait is then the test's).
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert time.monotonic() < deadline, "the reserve did not warm up in 120 s"
            time.sleep(0.05)
    dist.barrier()
    if ctx.iteration == 0 and ctx.rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


train()
