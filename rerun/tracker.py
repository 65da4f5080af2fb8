"""The tracker file of rejected results (JSON lines) and the list of iterations to skip."""

from __future__ import annotations

import collections
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from restartable.rerun.errors import RerunConfigError

# Statuses, one per line of the file.
INITIAL_RUN = "initial_run"  # a result was rejected (the first time the step ran)
FIRST_RERUN_NOT_REPRODUCIBLE = "first_rerun_not_reproducible"
FIRST_RERUN_REPRODUCIBLE = "first_rerun_reproducible"
SECOND_RERUN_NOT_REPRODUCIBLE = "second_rerun_not_reproducible"
SECOND_RERUN_REPRODUCIBLE = "second_rerun_reproducible"
_REPRODUCIBLE = {FIRST_RERUN_REPRODUCIBLE, SECOND_RERUN_REPRODUCIBLE}


def job_id() -> str:
    """The scheduler's job id (the only environment variable ``rerun`` reads)."""
    return os.environ.get("SLURM_JOB_ID", "")


class ResultTracker:
    """Appends one JSON line per rejected result and per re-run outcome (fault path only)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            os.close(self._open())
        except OSError as e:
            raise RerunConfigError(
                f"result_rejected_tracker_filename ({str(path)!r}) must be a file this process "
                f"can append to ({e.strerror}): pick a writable path or pass None"
            ) from e

    def record(
        self,
        *,
        rank: int,
        iteration: int,
        status: str,
        result: float,
        message: str,
        hardware_id: str,
    ) -> None:
        line = {
            "ts": time.time(),
            "node": socket.gethostname(),
            "hardware": hardware_id,
            "job": job_id(),
            "rank": rank,
            "iteration": iteration,
            "status": status,
            "result": result if result == result else "nan",  # JSON has no NaN
            "message": message,
        }
        # One write of one line in append mode: lines of concurrent ranks do not interleave.
        with os.fdopen(self._open(), "a") as f:
            f.write(json.dumps(line) + "\n")

    def _open(self) -> int:
        # 0600 and never through a symbolic link: the path may lie in a shared directory
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        return os.open(self.path, flags, 0o600)


def iterations_to_skip(path: str | os.PathLike[str]) -> list[int]:
    """Iterations whose batch is reproducibly bad on the same rank: skip them on the next launch.

    An iteration is listed when the same (rank, iteration) was recorded as reproducible at least
    twice (e.g. in place, then on other hardware: the model/data really produced it), unless
    several ranks flagged that iteration in one job (then the cause is not the batch of a rank).
    A missing file lists nothing.
    """
    p = Path(path)
    if not p.exists():
        return []
    records: list[dict[str, Any]] = []
    for line in p.read_text().splitlines():
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut by a crash: the rest of the file is still valid
    ranks_per_job_iter: dict[tuple[str, int], set[int]] = collections.defaultdict(set)
    for r in records:
        ranks_per_job_iter[(r.get("job", ""), r["iteration"])].add(r["rank"])
    counts: collections.Counter[tuple[int, int]] = collections.Counter()
    for r in records:
        if r["status"] not in _REPRODUCIBLE:
            continue
        if len(ranks_per_job_iter[(r.get("job", ""), r["iteration"])]) > 1:
            continue
        counts[(r["rank"], r["iteration"])] += 1
    return sorted({it for (_rank, it), n in counts.items() if n >= 2})
