"""The example's run directory: resume an unfinished run, refuse to redo a finished one, --fresh.

A run directory holds the persistent checkpoints (``ckpt/``), the fault records
(``fired.jsonl``: a fault fires once per run), the report and, once the run finished,
``finished.json``. Per launch it also gets ``journal/<launch>/`` (the framework's run journal,
which the report reads) and ``logs/<launch>/``.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

FINISHED = "finished.json"
# What --fresh removes: everything a later launch would resume from or report on.
_RUN_STATE = ("ckpt", "fired", "fired.jsonl", "report.json", FINISHED)
_FRESH_WAIT_S = 120.0  # how long ranks other than 0 wait for rank 0 to clear the directory


def launch_id() -> str:
    """A name every rank of this launch agrees on: the framework's launch id
    (``inprocess.launch``'s, the same in every in-job restart round, so a restarted round finds
    the node-local checkpoints and the journal of its launch; under Slurm one per job attempt),
    else the torchrun run, or the store address."""
    from restartable.inprocess.protocol.environment import launch_id as framework_launch_id

    found = framework_launch_id() or os.environ.get("TORCHELASTIC_RUN_ID")
    return found or f"{os.environ.get('MASTER_ADDR')}-{os.environ.get('MASTER_PORT')}"


def finished(run_dir: Path) -> dict[str, Any] | None:
    """What ``mark_finished`` wrote, or None while the run has not finished."""
    try:
        return dict(json.loads((run_dir / FINISHED).read_text()))
    except (OSError, ValueError):
        return None


def mark_finished(run_dir: Path, *, steps: int, loss: float) -> None:
    """Rank 0, after the last step: a later launch with the same directory has nothing to do."""
    (run_dir / FINISHED).write_text(json.dumps({"steps": steps, "final_loss": loss}))


def start_fresh(run_dir: Path, *, initial_rank: int, launch: str) -> None:
    """Clear the run state of ``run_dir`` (``--fresh``): rank 0 removes, the others wait.

    Every rank calls it before it builds its checkpoint manager. Rank 0 removes the run state
    and then creates a marker for this launch; the others wait for that marker (bounded), so
    none of them reads or creates anything in the directory while it is being cleared.
    """
    marker = run_dir / f".fresh-{launch}"
    if initial_rank == 0:
        for old in run_dir.glob(".fresh-*"):
            old.unlink(missing_ok=True)
        for name in _RUN_STATE:
            path = run_dir / name
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
        marker.touch()
        return
    deadline = time.monotonic() + _FRESH_WAIT_S
    while not marker.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"--fresh: rank 0 did not clear {run_dir} within {_FRESH_WAIT_S:.0f} s: "
                "look at rank 0's output"
            )
        time.sleep(0.05)
