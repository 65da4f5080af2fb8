"""A job to probe from outside (tests/dist/test_trust_probe.py): trains slowly with both tiers.

``python workers_probe.py JOBDIR STEPS`` under ``inprocess.launch``: every rank saves every step
to the local tier and every other step to the persistent tier (both under JOBDIR), prints
``[rank r] step k``, and writes ``JOBDIR/finished-<rank>`` once ``train()`` returned.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

from restartable.checkpoint import CheckpointManager
from restartable.inprocess import context, restartable


def main(jobdir: str, steps: int) -> int:
    rank = int(os.environ["RANK"])
    Path(jobdir, "local", f"rank{rank}").mkdir(parents=True, exist_ok=True, mode=0o700)
    mgr = CheckpointManager(
        f"{jobdir}/persistent",
        persistent_every=2,
        keep=2,
        local_every=1,
        local_dir=f"{jobdir}/local/rank{rank}",
        timeout=20.0,
    )

    @restartable(
        backend="gloo",
        soft_timeout=5.0,
        hard_timeout=10.0,
        heartbeat_interval=0.5,
        barrier_timeout=20.0,
        completion_timeout=20.0,
        max_iterations=3,
    )
    def train() -> None:
        ctx = context()
        state = {"w": torch.zeros(1000), "rng": torch.get_rng_state()}
        first = (mgr.load_latest(state) or 0) + 1
        for step in range(first, steps + 1):
            ctx.ping(step=step)
            state["w"].fill_(float(step))
            mgr.save(step, state)
            print(f"step {step}", flush=True)
            time.sleep(0.2)
        mgr.wait()

    train()
    mgr.close()
    Path(jobdir, f"finished-{rank}").write_text("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
