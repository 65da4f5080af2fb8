"""Issue 52: the restart by node wired into a real job (the launcher's default, ``--restart-by
node``): two launchers on this machine play two nodes of two ranks; each hosts its node's store
and relay, its ranks meet there (``inprocess.restart.node_path``), and the job ends with the
loss of a run without faults, as on the per-rank path (``--restart-by rank``, still chosen on
request). A launcher SIGKILLed: the other node's ranks go on, no hang."""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path
from typing import Any

import pytest

from tests.dist.test_launcher_recovery import FAST, SCRIPT, results
from tests.dist.workers_launcher_recovery import clean_loss
from tests.multiproc import JobOutput, run_job, slow

pytestmark = pytest.mark.timeout(150)


def _two_nodes(
    job: dict[str, Any],
    *,
    kill_node: int | None,
    restart_by: str | None = None,
    kill_when_raised: float | None = None,
) -> tuple[JobOutput, Path]:
    """The job on two launchers; ``restart_by`` None: no ``--restart-by`` (the default);
    ``kill_when_raised``: the launcher is killed that long after the job's fault, not at a
    step (``workers_launcher_recovery.two_nodes``)."""
    d = Path(tempfile.mkdtemp(prefix="node-path-"))
    job = {**job, "dir": str(d), "config": {**FAST, **job.get("config", {})}}
    opts = {
        "dir": str(d),
        "nproc": 2,
        "kill_after_step": 2,
        "kill_node": kill_node,
        "kill_when_raised": kill_when_raised,
        "job": job,
        "launcher_args": [
            *("--monitor-interval", "0.05", "--stop-grace", "2"),
            *(() if restart_by is None else ("--restart-by", restart_by)),
        ],
    }
    return run_job([SCRIPT, "two_nodes", json.dumps(opts)], deadline=120), d


def test_a_default_launch_restarts_through_the_node_relays_and_gives_the_clean_loss() -> None:
    # No --restart-by: the default. 3 active + 1 reserve over two nodes: ctx.rank 1 raises at
    # step 3 (iteration 0), then ctx.rank 2 is SIGKILLed at step 6 of iteration 1; the reserve
    # takes its place. Each launcher's log says its relay relayed both restarts.
    job, d = _two_nodes(
        {
            "steps": 10,
            "step_time": 0.05,
            "raise_at": {"step": 3, "rank": 1, "once": True},
            "kills": [{"iteration": 1, "rank": 2, "step": 6}],
            "config": {"active_world_size": 3},
        },
        kill_node=None,
    )
    assert job.returncode == 0, job.output
    for node in (0, 1):
        for it in (0, 1):
            assert f"node {node} relay: restart after iteration {it} relayed" in job.output, (
                job.output
            )
    totals = {r["total"] for r in results(d).values()}
    assert totals == {clean_loss(10, 3)}, job.output


def test_restart_by_rank_on_request_keeps_the_per_rank_path() -> None:
    # --restart-by rank: no node store, no relay; every rank meets at the job's store, and the
    # same job restarts to the same loss.
    job, d = _two_nodes(
        {
            "steps": 8,
            "step_time": 0.05,
            "raise_at": {"step": 3, "rank": 1, "once": True},
            "config": {"active_world_size": 3},
        },
        kill_node=None,
        restart_by="rank",
    )
    assert job.returncode == 0, job.output
    assert "relay: restart after" not in job.output, job.output
    assert {r["total"] for r in results(d).values()} == {clean_loss(8, 3)}, job.output


def _node_1_lost(steps: int, kill_when_raised: float | None) -> str:
    """ctx.rank 0 (node 0) raises at step 3; node 1's launcher is SIGKILLed (its ranks die with
    it: PR_SET_PDEATHSIG) at step 2 or ``kill_when_raised`` after the raise. Node 0's two
    ranks must go on alone, through node 0's relay; returns the job's output."""
    job, d = _two_nodes(
        {
            "steps": steps,
            "step_time": 0.1,
            "raise_at": {"step": 3, "rank": 0, "once": True},
            "config": {"active_world_size": 3, "min_active_world_size": 2},
        },
        kill_node=1,
        kill_when_raised=kill_when_raised,
    )
    assert job.returncode == 0, job.output
    assert "node 0 relay: restart after iteration 0 relayed" in job.output, job.output
    assert {r["world_size"] for r in results(d).values()} == {2}, job.output
    return job.output


@slow("a launcher case")
def test_a_launcher_lost_mid_restart_leaves_the_other_node_going_on() -> None:
    # The driver SIGKILLs node 1's launcher as step 2 is logged, about when the fault is: node
    # 0's relay counts node 1 gone (its beat goes stale) instead of waiting for it.
    _node_1_lost(12, kill_when_raised=None)


def test_a_launcher_killed_mid_restart_is_counted_gone_and_the_other_node_goes_on() -> None:
    # Node 1's launcher -- its relay -- is SIGKILLed as the fault is raised, before the restart
    # is decided (it takes ~30 ms; the driver looks every 10 ms). Node 0's relay waits for node
    # 1's count, then counts node 1 gone (its beat goes stale): the first restart already
    # leaves node 1 out, no hang.
    output = _node_1_lost(10, kill_when_raised=0.0)
    assert re.search(r"restart 1: exception on rank 0; .*ranks 0,1,2 -> 0,1 \(", output), output
