"""The restart core on the node path (issue 52): the ranks of ``test_restart_core`` with, per
simulated node, the launcher's own ``NodeHost`` (node store and relay) hosted by the test
(``tests.multiproc``'s ``restart_by="node"``), as ``python -m restartable.launch`` does by default.

The whole core suite runs this way with ``RESTARTABLE_TEST_RESTART_BY=node python -m pytest
tests/dist/test_restart_core.py``; here, by default, the cases that exercise the node barrier
differently: an exception and a hang on a job of two nodes, and a stop decided by a node's
decider rank and relayed to every rank."""

from __future__ import annotations

import pytest

from tests.dist import test_restart_core as core
from tests.multiproc import run_ranks, slow

W = core.W


@pytest.mark.parametrize("fail_rank", [3, 0])
def test_an_exception_on_a_job_of_two_nodes_restarts_every_rank_through_the_relays(
    fail_rank: int,
) -> None:
    # Two nodes of two ranks, each with its relay: the faulty rank's node and the other one
    # count themselves once each on the job store; every rank waits on its node's store.
    outs = run_ranks(
        4,
        target=f"{W}:exception_mid_collective",
        kwargs={"fail_rank": fail_rank},
        host_store=True,
        local_world_size=2,
        restart_by="node",
        deadline=60,
    )
    for o in outs:
        r = o.result
        assert r["pid"] == o.pid, o.output  # the same process ran both iterations
        assert [s["iteration"] for s in r["seen"]] == [0, 1], o.output
        assert r["result"] == {"sum": 10.0, "iteration": 1}, o.output


def test_a_repeated_fault_is_stopped_by_the_node_decider_on_every_rank(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RESTARTABLE_TEST_RESTART_BY", "node")
    core.test_max_iterations_stops_every_rank_with_the_same_error()


@slow("the per-rank core suite covers the hang; the node barrier's part is the exception's")
def test_a_hang_is_interrupted_and_restarted_on_the_node_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RESTARTABLE_TEST_RESTART_BY", "node")
    core.test_soft_timeout_hang_interrupts_sleep_and_restarts()
