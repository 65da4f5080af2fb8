"""The launcher's exit statuses and the autoresume flag file a batch script reads to requeue.

    status 0   the job finished                      -> flag removed (never requeued)
    status 2   the job cannot start as configured (a bad flag, a missing script, an unreachable
               store, an impossible world): one line before any rank starts, or the script's
               own usage error                       -> flag removed (it would fail again)
    status 17  results failed validation (rerun)     -> flag removed (a model issue: requeueing
                                                        would fail again)
    status 70  an application fault: the in-process restart stopped on the same exception at
               the same place each time (a bug)      -> flag removed (requeueing would hit it
                                                        again; the launcher's exit line and its
                                                        "launcher_exit" journal record say why)
    status 75  requeue: in-job restarts exhausted, a node is gone, or the job was preempted
                                                     -> flag written while job retries remain
    other      the status of the first rank that failed in a job without ``@restartable``

The flag is a small JSON file, written atomically (temporary file + rename), so a script never
reads half of it. The attempt number is decided once per job (``attempt_number``, at the
launcher's start): Slurm's ``SLURM_RESTART_COUNT`` (unset: 0), or the flag of the previous
attempt outside Slurm.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from restartable.checkpoint.private_files import replace_private
from restartable.inprocess.clock import SYSTEM, Clock
from restartable.inprocess.protocol.environment import job_attempt

EXIT_DONE = 0
EXIT_VALIDATION_FAILED = 17  # rerun: the same wrong result on other hardware (not requeued)
EXIT_RERUN_ELSEWHERE = 16  # rerun: re-run the step on other hardware (requeue)
EXIT_REQUEUE = 75  # EX_TEMPFAIL: try again later (also what a preempted job exits with)
EXIT_APPLICATION = 70  # EX_SOFTWARE: a bug in the training code (not requeued)
# A rank exiting with one of these speaks for the whole job: the launcher neither respawns it
# nor restarts the job in place.
VERDICT_STATUSES = frozenset({EXIT_VALIDATION_FAILED, EXIT_RERUN_ELSEWHERE, EXIT_REQUEUE})


@dataclass(frozen=True)
class Flag:
    """What the flag file holds: why the job asks to be requeued, and for which attempt."""

    reason: str
    status: int
    attempt: int  # 0 for the first run of the job, 1 after one requeue, ...
    retries_left: int
    time: float


def attempt_number(flag_path: str | None, environ: dict[str, str] | None = None) -> int:
    """This run's attempt (0 = first), decided once per job: ``environment.job_attempt`` (the
    launcher's RESTARTABLE_ATTEMPT; under Slurm ``SLURM_RESTART_COUNT``, unset = 0, never the
    flag file, which another node's launcher of this very attempt may have written already),
    else the previous flag's attempt + 1, else 0. The launcher calls it once, at its start."""
    env = os.environ if environ is None else environ
    decided = job_attempt(env)
    if decided is not None:
        return decided
    if flag_path and Path(flag_path).is_file():
        try:
            return int(json.loads(Path(flag_path).read_text())["attempt"]) + 1
        except (ValueError, KeyError, TypeError):
            return 0
    return 0


def settle(
    flag_path: str | None,
    *,
    status: int,
    reason: str,
    attempt: int,
    max_retries: int,
    clock: Clock = SYSTEM,
) -> bool:
    """Write or remove the flag for a job that ends with ``status``; True when written.

    Written only for ``EXIT_REQUEUE`` / ``EXIT_RERUN_ELSEWHERE`` while ``attempt <
    max_retries`` (``num_job_retries_on_failure``); any other end removes a stale flag, so a
    finished job or one that failed validation is never requeued.
    """
    if flag_path is None:
        return False
    path = Path(flag_path)
    requeue = status in (EXIT_REQUEUE, EXIT_RERUN_ELSEWHERE) and attempt < max_retries
    if not requeue:
        path.unlink(missing_ok=True)
        return False
    flag = Flag(
        reason=reason,
        status=status,
        attempt=attempt,
        retries_left=max_retries - attempt - 1,
        time=clock.wall(),
    )
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    replace_private(path, (json.dumps(asdict(flag), sort_keys=True) + "\n").encode())
    return True
