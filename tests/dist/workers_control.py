"""A job whose control plane tests/dist/test_control_trust.py attacks from the store's port.

``python workers_control.py JOBDIR STEPS HANG_AT`` under ``inprocess.launch``: every rank trains
STEPS steps of 0.2 s, printing ``[rank r] iteration i step k``; at step 2 it starts a child
process that says whether it sees the job's secret (``child sees secret: ...``); rank 1 hangs
at step HANG_AT of iteration 0 (0: never), printing ``hanging``; every rank writes
``JOBDIR/finished-<rank>`` once ``train()`` returned.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from restartable.inprocess import context, restartable

SOFT_TIMEOUT_S = 5.0  # the test bounds how long a hang may last with this


def main(jobdir: str, steps: int, hang_at: int) -> int:
    rank = int(os.environ["RANK"])

    @restartable(
        backend="gloo",
        soft_timeout=SOFT_TIMEOUT_S,
        hard_timeout=10.0,
        heartbeat_interval=0.5,
        barrier_timeout=20.0,
        completion_timeout=20.0,
        max_iterations=3,
    )
    def train() -> None:
        ctx = context()
        for step in range(1, steps + 1):
            ctx.ping(step=step)
            if step == 2:
                probe = "import os; print('RESTARTABLE_SECRET' in os.environ)"
                seen = subprocess.run(
                    [sys.executable, "-c", probe], capture_output=True, text=True, check=True
                ).stdout.strip()
                print(f"child sees secret: {seen}", flush=True)
            if step == hang_at and rank == 1 and ctx.iteration == 0:
                print("hanging", flush=True)
                time.sleep(3600)
            print(f"iteration {ctx.iteration} step {step}", flush=True)
            time.sleep(0.2)

    train()
    Path(jobdir, f"finished-{rank}").write_text("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
