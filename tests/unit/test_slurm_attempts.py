"""Issue 32, single process: one launch id per Slurm job attempt, the attempt decided once per job
(never from a flag file another node's launcher of the same attempt wrote), and the exit status
``inprocess.srun_task`` gives an srun task whose rank was killed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from restartable.inprocess.launch import autoresume
from restartable.inprocess.protocol import environment
from restartable.inprocess.srun_task.task import parse_args, task_status


def test_under_slurm_the_attempt_is_slurms_even_when_a_flag_exists(tmp_path: Path) -> None:
    # launch.sbatch, attempt 0: node 0's launcher wrote the flag (attempt 0) and exited; node 1's
    # launcher then read it and called its own attempt 1 (the finding: attempt 0 / attempt 1).
    flag = tmp_path / "autoresume.json"
    assert autoresume.settle(str(flag), status=75, reason="r", attempt=0, max_retries=2)
    slurm = {"SLURM_JOB_ID": "41"}
    assert autoresume.attempt_number(str(flag), environ=slurm) == 0
    assert autoresume.attempt_number(str(flag), environ={**slurm, "SLURM_RESTART_COUNT": "1"}) == 1
    # The launcher's decision, handed to its ranks, wins over everything.
    assert autoresume.attempt_number(str(flag), environ={"RESTARTABLE_ATTEMPT": "3"}) == 3
    assert json.loads(flag.read_text())["attempt"] == 0


@pytest.mark.parametrize(
    ("env", "launch", "attempt"),
    [
        ({"SLURM_JOB_ID": "41"}, "slurm-41-0", 0),
        ({"SLURM_JOB_ID": "41", "SLURM_RESTART_COUNT": "2"}, "slurm-41-2", 2),
        ({"SLURM_JOB_ID": "41", "RESTARTABLE_LAUNCH_ID": "mine"}, "mine", 0),
        ({}, None, None),
    ],
)
def test_each_slurm_attempt_has_its_own_launch_id(
    env: dict[str, str], launch: str | None, attempt: int | None
) -> None:
    # Before: every attempt of a requeued job journalled under the same id (its job id).
    assert environment.launch_id(env) == launch
    assert environment.job_attempt(env) == attempt
    base = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "29500"}
    assert environment.read_env({**base, **env}).launch == launch


@pytest.mark.parametrize(
    ("returncode", "job_status", "status"),
    [
        (0, None, 0),
        (75, 0, 75),  # preempted: the requeue status comes through
        (1, 0, 1),  # a failure of its own is a failure
        (-9, 0, 0),  # killed, and a reserve finished the job: a fault the job survived
        (-9, 75, 75),  # a killed launcher: the others asked for a requeue
        (-9, None, 137),  # killed, and the job failed or its outcome is unknown: the kill stands
        (-15, 0, 0),
    ],
)
def test_task_status(returncode: int, job_status: int | None, status: int) -> None:
    assert task_status(returncode, job_status) == status


def test_task_takes_a_module_and_its_arguments() -> None:
    args = parse_args(["--orphan-grace", "5", "-m", "restartable.launch", "--nnodes", "2", "t.py"])
    assert (args.module, args.script, args.args, args.orphan_grace) == (
        "restartable.launch", "restartable.launch", ["--nnodes", "2", "t.py"], 5.0,
    )  # fmt: skip
    args = parse_args(["train.py", "--steps", "3", "-m", "x"])  # a script's own "-m" is its own
    assert (args.module, args.script, args.args) == (None, "train.py", ["--steps", "3", "-m", "x"])
