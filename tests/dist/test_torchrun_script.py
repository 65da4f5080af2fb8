"""A user's torchrun script under ``inprocess.launch``: environment, misuse errors, tracebacks."""

from __future__ import annotations

import re
from pathlib import Path

from tests.multiproc import REPO_ROOT, run_job

SCRIPT = "tests/dist/workers_torchrun.py"


def _launch(*args: str) -> list[str]:
    return ["-m", "restartable.launch", "--nproc-per-node", "3", SCRIPT, *args]


def test_ranks_in_the_environment_follow_a_restart_and_local_rank_0_still_saves(
    tmp_path: Path,
) -> None:
    # Found by a user: RANK / WORLD_SIZE / LOCAL_RANK kept their launch values after a restart;
    # the DDP tutorial's `if LOCAL_RANK == 0` snapshot was never written again once the reserve
    # (launch local rank 2) had replaced rank 0.
    job = run_job(_launch("env", str(tmp_path)), deadline=120)
    assert job.returncode == 0, job.output
    lines = re.findall(r"\[rank (\d)\] iteration (\d) rank (\d)/2: (.*)", job.output)
    it1 = {slot: env for slot, it, _, env in lines if it == "1"}
    assert it1.get("2") == "RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=2 GROUP_RANK=0", (
        job.output
    )
    assert it1.get("1") == "RANK=1 WORLD_SIZE=2 LOCAL_RANK=1 LOCAL_WORLD_SIZE=2 GROUP_RANK=0", (
        job.output
    )
    assert (tmp_path / "snapshot-0").read_text() == "0"
    assert (tmp_path / "snapshot-1").read_text() == "2", job.output


def test_a_script_that_creates_its_own_group_gets_one_clear_line_at_once() -> None:
    # Found by a user: rank 0 failed with EADDRINUSE on MASTER_PORT (our store listens there)
    # and the other rank hung for 588 s.
    job = run_job(_launch("own_init"), deadline=120)
    assert job.returncode != 0, job.output
    assert "delete the init_process_group call" in job.output, job.output
    assert "EADDRINUSE" not in job.output, job.output


def test_exception_in_train_is_logged_with_its_traceback_once() -> None:
    # Found by a user: the exception's message only, no traceback, even with logging on.
    job = run_job(_launch("raise"), deadline=120)
    assert job.returncode == 0, job.output
    assert "in _inner_failure" in job.output, job.output
    tb = [line for line in job.output.splitlines() if "Traceback (most recent call last)" in line]
    assert len(tb) == 1 and tb[0].startswith("[rank 1]"), job.output


def test_restarts_of_the_readme_style_script_take_no_group_timeout(tmp_path: Path) -> None:
    # Found by a user: 2 of 5 restarts of the README-style script took 12.5 s (the group
    # timeout) with torch's socket noise. The destroyed group stayed referenced by reference
    # cycles (the local tier's walk of the state, DDP itself) until the cyclic GC ran; here the
    # GC is off, so every restart would wait for the 5 s group timeout.
    job = run_job(
        ["-m", "restartable.launch", "--nproc-per-node", "2", SCRIPT, "readme", str(tmp_path)],
        deadline=120,
    )
    assert job.returncode == 0, job.output
    # fault -> state restored on rank 0, from the framework's console line (inprocess.restart.story)
    took = [float(t) for t in re.findall(r"restart \d: .* ([0-9.]+) s after the fault", job.output)]
    assert len(took) == 5, job.output
    assert max(took) < 3.0, (took, job.output)  # the group timeout is 5 s
    assert "still referenced" not in job.output and "waitForInput" not in job.output, job.output


def test_the_minimal_example_survives_a_fault_and_runs_twice(tmp_path: Path) -> None:
    # examples/minimal.py, shown in the README: one exception on rank 1 at step 30; the same
    # command again, as a user repeats it, in the same directory.
    command = [
        "-m",
        "restartable.launch",
        "--nproc-per-node",
        "3",
        str(REPO_ROOT / "examples" / "minimal.py"),
        "--fail-at",
        "30",
    ]
    job = run_job(command, deadline=120, cwd=tmp_path)
    assert job.returncode == 0, job.output
    assert re.search(
        r"\[rank 0\] restart 1: exception on rank 1; .* resumed step 2\d: memory on 2 ranks ",
        job.output,
    ), job.output
    assert re.search(r"\[rank 0\] done: loss \d", job.output), job.output
    assert "RuntimeError: injected fault at step 30" in job.output
    # Again: the run finished, so nothing trains, nothing restarts, and it says so.
    again = run_job(command, deadline=60, cwd=tmp_path)
    assert again.returncode == 0, again.output
    assert "[rank 0] runs/minimal holds a finished 60-step run: nothing to do" in again.output, (
        again.output
    )
    assert "restart" not in again.output and "Traceback" not in again.output, again.output
