"""A short job that writes every kind of file the framework writes (tests/dist/test_private_job.py).

``python workers_private.py JOBDIR`` under ``inprocess.launch``: both checkpoint tiers, the
watchdogs' logs and a fired fault's record under JOBDIR (the journal goes where
``RESTARTABLE_JOURNAL_DIR`` says); rank 1 raises once at step 3, so the job restarts in process
once and then trains to its end. The script itself writes nothing.
"""

from __future__ import annotations

import os
import sys

import torch

from restartable.checkpoint import CheckpointManager
from restartable.inprocess import context, restartable
from restartable.inprocess import faults as fi

STEPS = 6
FAULT_STEP = 3


def main(jobdir: str) -> int:
    rank = int(os.environ["RANK"])
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
        monitor_process_logdir=f"{jobdir}/watchdog",
    )
    def train() -> None:
        ctx = context()
        state = {"w": torch.zeros(100), "rng": torch.get_rng_state()}
        first = (mgr.load_latest(state) or 0) + 1
        for step in range(first, STEPS + 1):
            ctx.ping(step=step)
            fi.inject("exception", rank=1, step=FAULT_STEP, current_step=step, record_dir=jobdir)
            state["w"].fill_(float(step))
            mgr.save(step, state)
        mgr.wait()

    train()
    mgr.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
