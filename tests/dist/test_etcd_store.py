"""Multi-process tests with the coordination store on a real etcd cluster (CPU, gloo)."""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.dist.workers_etcd import reference_loss
from tests.etcd_cluster import EtcdCluster, skip_reason
from tests.multiproc import run_job, run_ranks, slow

pytestmark = pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason()))
W = "tests.dist.workers_etcd"


@pytest.fixture
def cluster() -> Iterator[EtcdCluster]:
    with EtcdCluster(members=3) as c:
        yield c


def _env(cluster: EtcdCluster, job: str) -> dict[str, str]:
    return {"INPROCESS_STORE": cluster.url, "INPROCESS_JOB_ID": job}


def test_gloo_process_group_over_the_etcd_store(cluster: EtcdCluster) -> None:
    outs = run_ranks(2, target=f"{W}:gloo_all_reduce", env=_env(cluster, "gloo"), deadline=60)
    assert [o.result["sum"] for o in outs] == [3.0, 3.0]


def test_restartable_job_on_etcd_survives_exception_kill_and_leader_loss(
    cluster: EtcdCluster,
) -> None:
    steps = 14
    killed: list[str] = []

    def kill_leader_on_request(procs: Any) -> None:
        # run_ranks' result directory holds the kwargs file named on the command line.
        results = Path(procs[0].args[-1]).parent

        def serve() -> None:
            deadline = time.monotonic() + 80
            while time.monotonic() < deadline:
                if (results / "kill-leader").exists():
                    killed.append(cluster.leader())
                    cluster.kill(killed[-1])
                    (results / "leader-killed").touch()
                    return
                time.sleep(0.01)

        threading.Thread(target=serve, daemon=True).start()

    outs = run_ranks(
        3,
        target=f"{W}:restartable_job",
        kwargs={"steps": steps, "exception_at": 3, "kill_at": 6, "leader_at": 9},
        env=_env(cluster, "job"),
        deadline=90,
        expect_success=False,
        on_started=kill_leader_on_request,
    )
    dead = [o for o in outs if o.returncode != 0]
    assert len(dead) == 1 and dead[0].returncode == -9, [o.returncode for o in outs]
    alive = [o for o in outs if o.returncode == 0]
    losses = [o.result["loss"] for o in alive if o.result["loss"] is not None]
    assert len(losses) == 2, [o.result for o in alive]
    expected = reference_loss(steps, active=2)
    assert all(math.isclose(x, expected, rel_tol=1e-5) for x in losses), (losses, expected)
    assert len(killed) == 1, "the etcd leader was killed mid-run"
    iterations = {s["iteration"] for o in alive for s in o.result["seen"]}
    assert iterations == {0, 1, 2}, [o.result["seen"] for o in alive]
    # Without a launcher, the last rank to leave (the killed one counts as gone) deleted every
    # key of the job.
    from restartable.inprocess.etcd import EtcdStore

    with EtcdStore(cluster.url, prefix="job", timeout=10) as after:
        assert after.delete_all() == 0


@slow("tests/dist/test_example.py runs the launcher on etcd through the same faults")
def test_launcher_with_store_flag_survives_exception_and_kill(cluster: EtcdCluster) -> None:
    # A stale key of an earlier run with the same job id (a requeued Slurm job keeps its id):
    # "iteration 0 is done" would end every rank at once if the launcher did not clear it.
    from restartable.inprocess.etcd import EtcdStore
    from restartable.inprocess.protocol import keys

    with EtcdStore(cluster.url, prefix="launch-x", timeout=10) as stale:
        stale.set(keys.end_key(0), keys.OUTCOME_DONE)
    argv = ["-m", "restartable.launch", "--nproc-per-node", "3", "--store", cluster.url]
    argv += ["--job-id", "launch-x", "tests/dist/workers_etcd.py", "launch"]
    job = run_job(argv, deadline=90)
    assert job.returncode == 0, job.output
    losses = [float(line.split()[-1]) for line in job.output.splitlines() if " loss " in line]
    expected = reference_loss(10, active=2)
    assert len(losses) == 2 and all(math.isclose(x, expected, rel_tol=1e-5) for x in losses), (
        losses,
        expected,
        job.output,
    )
    # The ranks' keys were on etcd, in round 0's namespace (the job id itself) ...
    counts = [int(line.split()[-1]) for line in job.output.splitlines() if "etcd keys of" in line]
    assert len(counts) == 2 and all(n > 0 for n in counts), job.output
    assert "etcd keys of launch-x:" in job.output, job.output
    # ... and the launcher deleted every key of the job when it was over.
    with EtcdStore(cluster.url, prefix="launch-x", timeout=10) as after:
        assert after.delete_all() == 0


def test_two_launchers_on_etcd_lose_node_0_and_node_1_trains_on(
    cluster: EtcdCluster, tmp_path: Path
) -> None:
    # Issue 18: two launchers play two nodes of 2 ranks; node 0's (the one that started the
    # job, drew the launch id and published it) is SIGKILLed with its ranks, the two that train.
    # Nothing of the job lived there: node 1's reserves take over and finish, its launcher
    # ends the job with status 0 and, the last launcher out, deletes the job's keys.
    from tests.dist.test_launcher_recovery import FAST, SCRIPT, results
    from tests.dist.workers_launcher_recovery import clean_loss

    job = {
        "steps": 12,
        "step_time": 0.1,
        "dir": str(tmp_path),
        "config": {**FAST, "active_world_size": 2, "min_active_world_size": 2},
    }
    opts = {
        "dir": str(tmp_path),
        "nproc": 2,
        "kill_after_step": 2,
        "kill_node": 0,
        "job": job,
        "launcher_args": [
            "--monitor-interval",
            "0.05",
            "--stop-grace",
            "2",
            "--store",
            cluster.url,
            "--job-id",
            "two-nodes",
        ],
    }
    out = run_job([SCRIPT, "two_nodes", json.dumps(opts)], deadline=120)
    assert out.returncode == 0, out.output + (tmp_path / "node0.log").read_text()
    done = results(tmp_path)
    assert set(done) == {2, 3}, (done, out.output)  # node 1's ranks, which were reserves
    assert all(r["total"] == clean_loss(12, 2) and r["world_size"] == 2 for r in done.values())
    assert "control store is gone" not in out.output, out.output
    from restartable.inprocess.etcd import EtcdStore

    with EtcdStore(cluster.url, prefix="two-nodes", timeout=10) as after:
        assert after.delete_all() == 0  # node 1's launcher deleted every key of the job


@slow("a launcher case")
def test_in_job_restart_on_etcd_uses_a_fresh_namespace_per_round(cluster: EtcdCluster) -> None:
    # tests/dist/test_launcher_recovery.py's in-job restart case, with the store on etcd: round
    # 1's ranks work under "<job>/round1", so no key of round 0 (whose in-process path stopped)
    # is read again; the job resumes from the checkpoint and ends with the clean loss.
    from restartable.inprocess.etcd import EtcdStore
    from tests.dist.test_launcher_recovery import launch, results, steps
    from tests.dist.workers_launcher_recovery import clean_loss

    opts = {
        "steps": 8,
        "ckpt_every": 2,
        "raise_at": {"step": 5, "rank": 1, "once": True},
        "config": {"max_iterations": 1},
    }
    flags = ("--max-restarts", "1", "--store", cluster.url, "--job-id", "inj")
    job, d = launch(2, opts, *flags)
    assert job.returncode == 0, job.output
    assert "in-job restart 1/1: the in-process restart gave up: max_iterations (1)" in job.output
    assert [s["step"] for s in steps(d)] == [0, 1, 2, 3, 4, 4, 5, 6, 7], job.output
    assert all(r["total"] == clean_loss(8, 2) for r in results(d).values())
    with EtcdStore(cluster.url, prefix="inj", timeout=10) as after:
        assert after.delete_all() == 0  # every round's keys were deleted at the end
