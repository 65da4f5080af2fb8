"""Issue 47, "true words": what a user reads about a run says what happened."""

from __future__ import annotations

from pathlib import Path

from restartable.inprocess import journal, report
from tests.multiproc import run_job

SCRIPT = "tests/dist/workers_words.py"


def _launch(*args: str) -> list[str]:
    return ["-m", "restartable.launch", "--nproc-per-node", "3", SCRIPT, *args]


def test_an_error_of_the_ranks_own_code_inside_torch_distributed_is_its_error_with_traceback() -> (
    None
):
    # Found by a user: an operator DTensor cannot shard, hit on every rank, was logged as
    # "rank N: a collective failed" (a WARNING meant for a peer's fault) and the user's own
    # frame was never printed.
    job = run_job(_launch("dtensor"), deadline=150)
    assert job.returncode == 0, job.output
    assert "a collective failed" not in job.output, job.output
    # One traceback (the user's frame once) even when both ranks raised it before the restart
    # (tests/unit/test_raised.py: the other rank's one line).
    assert job.output.count(", in user_code") == 1, job.output
    assert "Sharding propagation failed" in job.output, job.output
    assert "iteration 1 rank 0: done" in job.output, job.output


def test_after_a_kill_the_restart_line_names_each_ranks_tier(tmp_path: Path) -> None:
    # Found by a user: "resumed step 16 from the memory tier" after a SIGKILL: the reserve that
    # took the killed rank's place restored from the node-local copy (the journal said so).
    job = run_job(
        [
            "-m",
            "restartable.launch",
            "--nproc-per-node",
            "3",
            "examples/ddp_tutorial.py",
            "2",
            "1",
            "--kill-at",
            "16",
            "--ckpt",
            str(tmp_path),
        ],
        deadline=150,
        env={journal.ENV_DIR: str(tmp_path / "journal")},
    )
    assert job.returncode == 0, job.output
    assert (
        "[rank 2] restart 1: dead on rank 0 (collateral, not counted: rank(s) 1); ranks 0,1 -> "
        "2,1 (reserve: -); resumed step 15: memory on 1 rank, node-local on 1 rank (the reserve) "
    ) in job.output, job.output
    assert "[rank 2] done: loss" in job.output, job.output
    assert "replaces a killed rank" not in job.output  # its node-local copy survives a kill
    (rep,) = report.reports(tmp_path / "journal")
    (w,) = rep.windows
    assert w.tiers == "memory on 1 rank, node-local on 1 rank (the reserve)", w
    assert "node-local on 1 rank (the reserve)" in report.format_report(rep)


def test_a_memory_only_checkpoint_with_a_reserve_warns_once_at_start(tmp_path: Path) -> None:
    # Found by a user: examples/minimal.py's configuration (the local tier in memory only) with
    # a reserve said "no checkpoint to resume from (started over)" after a SIGKILL, and nothing
    # had warned.
    job = run_job(
        [
            "-m",
            "restartable.launch",
            "--nproc-per-node",
            "3",
            "examples/minimal.py",
            "--steps",
            "5",
            "--ckpt",
            str(tmp_path),
        ],
        deadline=120,
    )
    assert job.returncode == 0, job.output
    warnings = [ln for ln in job.output.splitlines() if "replaces a killed rank" in ln]
    assert len(warnings) == 1 and warnings[0].startswith("[rank 0] "), job.output
    assert "Fix: give CheckpointManager a node-local directory" in warnings[0]


def test_with_the_root_logger_at_info_a_restart_is_one_line_not_every_ranks_json() -> None:
    # Found by a user: with logging at INFO (the TP example sets it) every rank printed the
    # restart's raw JSON (~600 characters).
    job = run_job(_launch("info"), deadline=120)
    assert job.returncode == 0, job.output
    assert "restart {" not in job.output, job.output
    lines = [ln for ln in job.output.splitlines() if "restart 1: exception on rank 1" in ln]
    assert len(lines) == 1, job.output
