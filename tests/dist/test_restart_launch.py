"""``python -m inprocess.launch``: exit status, rank prefixes, signal forwarding, a restart."""

from __future__ import annotations

import signal

import pytest

from inprocess.launch import job_status
from tests.multiproc import run_job

SCRIPT = "tests/dist/workers_inprocess.py"


def _launch(mode: str, n: int = 2) -> list[str]:
    return ["-m", "inprocess.launch", "--nproc-per-node", str(n), SCRIPT, mode]


def test_failed_rank_sets_exit_status_and_siblings_keep_running() -> None:
    job = run_job(_launch("exit_codes"), deadline=30)
    assert job.returncode == 3, job.output
    assert "[rank 0] rank 0 finished after its sibling failed" in job.output


def test_rank_killed_while_job_succeeds_counts_as_success() -> None:
    job = run_job(_launch("killed"), deadline=30)
    assert job.returncode == 0, job.output


def test_sigterm_is_forwarded_to_every_rank() -> None:
    job = run_job(_launch("signals"), deadline=30, signal_when=("[rank 1] ready", signal.SIGTERM))
    assert job.returncode == 0, job.output
    assert "[rank 0] got SIGTERM" in job.output and "[rank 1] got SIGTERM" in job.output


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
