"""Issue 49: with ETCD=1 the sbatch scripts run the job's store on an etcd cluster inside the
allocation (a member per node), so on three nodes losing node 0's launcher is an in-process
restart of the others, not a requeue. A real three-node Slurm cluster on this machine, 1 CPU rank
per node (2 train, 1 warm reserve)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import slurm_cluster
from tests.etcd_cluster import skip_reason as etcd_skip_reason
from tests.multiproc import slow
from tests.slurm.conftest import Clusters
from tests.slurm.jobs import Job, final_loss, submit
from tests.slurm_cluster import SlurmCluster

_JOB_S = 420.0  # a deadline for one job (measured: see the prints; 2 cores, loaded machine)
STEPS = "120"
# 3 ranks, 2 train: the reserve on node 2 takes the place of node 0's rank.
# soft_timeout >= 5 s with etcd (a leader election stalls store calls 1-2 s): FAST's 3 is refused.
TRAIN_ARGS = "--soft-timeout 5 --hard-timeout 10 --persistent-every 20 --log-every 20 --active 2"
ENV = {"ETCD": "1", "STEPS": STEPS, "NPROC_PER_NODE": "1", "TRAIN_ARGS": TRAIN_ARGS}


@pytest.fixture
def slurm3(clusters: Clusters) -> Iterator[SlurmCluster]:
    """A three-node cluster (the session's two-node one is closed first: one per machine)."""
    reason = slurm_cluster.skip_reason() or etcd_skip_reason()
    if reason is not None:
        pytest.skip(reason)
    clusters.close()
    with SlurmCluster(nodes=3) as cluster:
        yield cluster


def _submit(cluster: SlurmCluster, out: Path, run_dir: Path) -> Job:
    env = {**ENV, "RUN_DIR": str(run_dir)}
    return submit(cluster, "launch.sbatch", out, env=env, sbatch=("--nodes=3",))


def _summary(what: str, job: Job, info: dict[str, str]) -> str:
    return (
        f"{what}: {info['JobState']} {info['ExitCode']} restarts {info['Restarts']} "
        f"{info['wall_s']} s, final loss {final_loss(job.log())}"
    )


def _assert_clean_end(job: Job, info: dict[str, str]) -> None:
    log = job.log()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "0"), log[
        -6000:
    ]
    assert f"final step {STEPS} (steps completed)" in log
    assert "autoresume" not in log  # no requeue was asked for
    assert not list(Path("/tmp").glob(f"restartable-etcd-{job.id}*")), "etcd data left behind"
    job.assert_nothing_left()


@slow("two 3-node jobs of ~1.5 min each; tests/dist/test_etcd_allocation.py covers the members")
@pytest.mark.timeout(2 * _JOB_S + 120)
def test_losing_node_0s_launcher_is_an_in_place_restart_with_etcd(
    slurm3: SlurmCluster, tmp_path: Path
) -> None:
    # Before: node 0's launcher hosted the store; its loss ended the attempt with 75 and a
    # requeue. With the allocation's etcd, the other nodes restart in process and finish.
    ref = _submit(slurm3, tmp_path / "ref", tmp_path / "ref-run")
    ref_info = ref.wait_end(_JOB_S)
    _assert_clean_end(ref, ref_info)
    healthy = r"3 member\(s\) on n1,n2,n3, healthy after [\d.]+ s; survives the loss of 1 node"
    assert re.search(healthy, ref.log()), ref.log()[-3000:]
    print(_summary("clean, ETCD=1, 3 nodes", ref, ref_info))

    job = _submit(slurm3, tmp_path / "kill", tmp_path / "kill-run")
    job.wait_output(r"step\s+40 ", _JOB_S)
    job.kill_launcher(0)
    info = job.wait_end(_JOB_S)
    _assert_clean_end(job, info)
    log = job.log()
    assert "launcher killed by SIGKILL; the job finished without it: exit 0" in log, log[-6000:]
    assert final_loss(log) == final_loss(ref.log())
    print(_summary("node 0's launcher SIGKILLed at step 40, ETCD=1", job, info))
