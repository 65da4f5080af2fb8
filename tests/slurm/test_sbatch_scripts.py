"""Issue 32: examples/slurm/*.sbatch, unmodified, on a real two-node Slurm cluster (2 nodes x 2
CPU ranks). Each job is bounded; the default suite runs the fault case of each script, the
rest run with RESTARTABLE_SLOW_TESTS=1 (preemption on every proctrack plugin, an external
SIGKILL, retries exhausted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.multiproc import slow
from tests.slurm.conftest import Clusters
from tests.slurm.jobs import FAST, Job, final_loss, submit
from tests.slurm_cluster import SlurmCluster

_JOB_S = 480.0  # a deadline for one job (measured 57-227 s on a 2-core machine at load 5-22)
# pytest-timeout's backstop (300 s in pyproject) is per test: one job, or three in a row.
one_job = pytest.mark.timeout(_JOB_S + 60)
three_jobs = pytest.mark.timeout(3 * _JOB_S + 60)
# Exception, a kill with a warm reserve to take over, and a hang (the soft timeout ends it).
FAULTS = "exception@rank0:step20,kill@rank1:step40,hang@rank2:step60"


def _env(run_dir: Path, **extra: str) -> dict[str, str]:
    return {"RUN_DIR": str(run_dir), "TRAIN_ARGS": FAST, **extra}


def _journal_launches(run_dir: Path) -> set[str]:
    out = set()
    for path in (run_dir / "journal").rglob("*.jsonl"):
        for line in path.read_text().splitlines():
            out.add(json.loads(line)["launch"])
    return out


@one_job
def test_train_sbatch_with_faults_completes(slurm: SlurmCluster, tmp_path: Path) -> None:
    # Before: the node-local directory was never made (train.py: error: --local-dir is not a
    # directory); then a job that recovered from a killed rank ended FAILED, exit 137.
    job = submit(
        slurm,
        "train.sbatch",
        tmp_path,
        sbatch=("--ntasks-per-node=2",),
        env=_env(tmp_path / "run", STEPS="100", FAULTS=FAULTS),
    )
    info = job.wait_end(_JOB_S)
    log = job.log()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), log[-5000:]
    assert "final step 100 (steps completed)" in log
    assert "rank killed by SIGKILL; the job finished without it: exit 0" in log
    job.assert_nothing_left()
    print(f"train.sbatch with {FAULTS}: {info['JobState']} {info['ExitCode']} {info['wall_s']} s")


@slow("one more job of ~1.5 min; train.sbatch's fault job covers the status path")
@one_job
def test_launch_sbatch_with_faults_completes(slurm: SlurmCluster, tmp_path: Path) -> None:
    job = submit(
        slurm,
        "launch.sbatch",
        tmp_path,
        env=_env(tmp_path / "run", STEPS="100", FAULTS=FAULTS, NPROC_PER_NODE="2"),
    )
    info = job.wait_end(_JOB_S)
    log = job.log()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), log[-5000:]
    assert "final step 100 (steps completed)" in log
    job.assert_nothing_left()
    print(f"launch.sbatch with {FAULTS}: {info['JobState']} {info['ExitCode']} {info['wall_s']} s")


@slow("one more job of ~2 min; the injected kill of the default case covers the status")
@one_job
def test_external_sigkill_of_a_rank(slurm: SlurmCluster, tmp_path: Path) -> None:
    job = submit(
        slurm,
        "train.sbatch",
        tmp_path,
        sbatch=("--ntasks-per-node=2",),
        env=_env(tmp_path / "run", STEPS="200", TRAIN_ARGS=FAST + " --active 3"),
    )
    job.wait_output(r"step\s+40 ", _JOB_S)
    job.kill_rank(1)
    info = job.wait_end(_JOB_S)
    log = job.log()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), log[-5000:]
    assert "final step 200 (steps completed)" in log
    job.assert_nothing_left()
    print(f"external SIGKILL of rank 1: {info['JobState']} {info['ExitCode']} {info['wall_s']} s")


@slow("one more job of ~2 min; the default launch.sbatch case covers the script")
@one_job
def test_launch_sbatch_survives_the_loss_of_one_launcher(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    # Before: the surviving node finished, and the job ended FAILED with srun's 137.
    env = _env(tmp_path / "run", STEPS="200", NPROC_PER_NODE="2", TRAIN_ARGS=FAST + " --active 2")
    job = submit(slurm, "launch.sbatch", tmp_path, env=env)
    job.wait_output(r"step\s+40 ", _JOB_S)
    job.kill_launcher(1)
    info = job.wait_end(_JOB_S)
    log = job.log()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), log[-5000:]
    assert "final step 200 (steps completed)" in log
    assert "launcher killed by SIGKILL; the job finished without it: exit 0" in log
    job.assert_nothing_left()
    print(f"launcher of node 1 killed: {info['JobState']} {info['ExitCode']} {info['wall_s']} s")


def _preempt(job: Job, at_step: int) -> None:
    job.wait_output(rf"step\s+{at_step} ", _JOB_S)
    job.scancel("--signal=TERM")  # what --signal=TERM@120 sends before the time limit


@slow("three plugins x (one preempted + requeued job) + an uninterrupted reference, ~8 min")
@three_jobs
@pytest.mark.parametrize("proctrack", ["cgroup", "pgid", "linuxproc"])
def test_preemption_requeue_resumes_with_the_same_loss(
    clusters: Clusters, tmp_path: Path, proctrack: str
) -> None:
    # Before, under linuxproc: the SIGTERM reached the store server and the watchdogs too; the
    # ranks died with `DistNetworkError: Broken pipe`, exit 1, no requeue. And every attempt
    # journalled under one launch id, the log was truncated by the requeue.
    cluster = clusters.get(proctrack)
    steps = "160"
    ref = submit(
        cluster,
        "train.sbatch",
        tmp_path / "ref",
        sbatch=("--ntasks-per-node=2",),
        env=_env(tmp_path / "ref-run", STEPS=steps),
    )
    ref_info = ref.wait_end(_JOB_S)
    assert ref_info["JobState"] == "COMPLETED", ref.log()[-5000:]
    job = submit(
        cluster,
        "train.sbatch",
        tmp_path / "pre",
        sbatch=("--ntasks-per-node=2",),
        env=_env(tmp_path / "run", STEPS=steps),
    )
    _preempt(job, 60)
    info = job.wait_end(2 * _JOB_S)
    log = job.log()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), log[
        -6000:
    ]
    assert "attempt 0: status 75 (checkpoint written): requeue 1/2" in log  # --open-mode=append
    assert "resuming" in log and f"final step {steps} (steps completed)" in log
    assert final_loss(log) == final_loss(ref.log())
    assert _journal_launches(tmp_path / "run") == {f"slurm-{job.id}-0", f"slurm-{job.id}-1"}
    job.assert_nothing_left()
    print(
        f"preemption under {proctrack}: {info['JobState']} {info['ExitCode']} restarts "
        f"{info['Restarts']} {info['wall_s']} s (reference {ref_info['wall_s']} s)"
    )


@slow("one preempted job of ~1.5 min; the requeue case covers the 75 path")
@one_job
def test_retries_exhausted_fails_with_75(slurm: SlurmCluster, tmp_path: Path) -> None:
    job = submit(
        slurm,
        "train.sbatch",
        tmp_path,
        sbatch=("--ntasks-per-node=2",),
        env=_env(tmp_path / "run", STEPS="400", MAX_RETRIES="0"),
    )
    _preempt(job, 40)
    info = job.wait_end(_JOB_S)
    log = job.log()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("FAILED", "75:0", "0"), log[
        -5000:
    ]
    assert "status 75 and no retry left (MAX_RETRIES=0)" in log
    job.assert_nothing_left()
    print(f"retries exhausted: {info['JobState']} {info['ExitCode']} {info['wall_s']} s")
