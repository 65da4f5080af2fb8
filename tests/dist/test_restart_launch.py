"""``python -m restartable.launch``: exit status, rank prefixes, signal forwarding, a restart."""

from __future__ import annotations

import signal
import time

import pytest

from restartable.inprocess.launch.cli import job_status
from tests.multiproc import run_job

SCRIPT = "tests/dist/workers_inprocess.py"
# A launcher and two ranks that return at once: 24 s at load 20-30 on the 2-core host, over 30 s
# once (the whole default suite beside three other engineers). Waited out only on a failure.
JOB_S = 90


def _launch(mode: str, n: int = 2) -> list[str]:
    return ["-m", "restartable.launch", "--nproc-per-node", str(n), SCRIPT, mode]


def test_failed_rank_sets_exit_status_and_siblings_keep_running() -> None:
    job = run_job(_launch("exit_codes"), deadline=JOB_S)
    assert job.returncode == 3, job.output
    assert "[rank 0] rank 0 finished after its sibling failed" in job.output


def test_rank_killed_while_job_succeeds_counts_as_success() -> None:
    job = run_job(_launch("killed"), deadline=JOB_S)
    assert job.returncode == 0, job.output


def test_sigterm_is_forwarded_to_every_rank() -> None:
    # Both ranks must have installed their handler before the signal, or the default action
    # kills the slower one.
    ready = ("[rank 0] ready", "[rank 1] ready")
    job = run_job(_launch("signals"), deadline=JOB_S, signal_when=(ready, signal.SIGTERM))
    assert job.returncode == 0, job.output
    assert "[rank 0] got SIGTERM" in job.output and "[rank 1] got SIGTERM" in job.output


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"  # a zombie is dead too
    except FileNotFoundError:
        return True


def test_ranks_die_with_a_killed_launcher() -> None:
    # The launcher hosts the store: once it is SIGKILLed its ranks can never finish, and they
    # must not linger as orphans.
    job = run_job(_launch("orphan"), deadline=60, signal_when=("[rank 1] pid", signal.SIGKILL))
    assert job.returncode == -signal.SIGKILL, job.output
    pids = [int(line.split()[-2]) for line in job.output.splitlines() if " ready" in line]
    assert pids, job.output
    end = time.monotonic() + 10
    while not all(_gone(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.05)
    assert all(_gone(p) for p in pids), pids


def test_restart_through_the_launcher() -> None:
    job = run_job(_launch("restart", n=3), deadline=40)
    assert job.returncode == 0, job.output
    for r in range(3):
        assert f"[rank {r}] iterations [0, 1]" in job.output


@pytest.mark.parametrize(
    ("codes", "status"),
    [
        ([0, 0], 0),
        ([0, -9], 0),  # killed and survived
        ([1, 0], 1),
        ([0, 75, 75], 75),
        ([-9, -15], 1),
    ],
)
def test_job_status_rule(codes: list[int], status: int) -> None:
    assert job_status(codes) == status
