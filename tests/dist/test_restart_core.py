"""Multi-process tests of the in-process restart core (CPU, gloo)."""

from __future__ import annotations

import pytest

from tests.multiproc import run_ranks

W = "tests.dist.workers_inprocess"


@pytest.mark.parametrize("fail_rank", [1, 0])
def test_exception_mid_collective_restarts_all_ranks_in_place(fail_rank: int) -> None:
    outs = run_ranks(
        3,
        target=f"{W}:exception_mid_collective",
        kwargs={"fail_rank": fail_rank},
        host_store=True,
        deadline=40,
    )
    for o in outs:
        r = o.result
        assert r["pid"] == o.pid  # same process ran both iterations
        assert [s["iteration"] for s in r["seen"]] == [0, 1], o.output
        assert r["result"] == {"sum": 6.0, "iteration": 1}  # the new group works
