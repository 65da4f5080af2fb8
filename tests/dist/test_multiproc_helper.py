"""The shared multi-process helper itself: results, surfaced tracebacks, deadlines."""

from __future__ import annotations

import time

import pytest

from tests.multiproc import RanksFailed, run_ranks


def test_ranks_run_a_real_gloo_collective() -> None:
    outs = run_ranks(3, target="tests.dist.workers_smoke:allreduce_rank_sum", deadline=60)
    assert [o.result["sum"] for o in outs] == [3.0, 3.0, 3.0]
    assert len({o.result["pid"] for o in outs}) == 3


def test_child_traceback_is_in_the_failure() -> None:
    with pytest.raises(RanksFailed, match="boom from rank 1"):
        run_ranks(2, target="tests.dist.workers_smoke:fail_on_rank1", deadline=30)


def test_deadline_kills_every_rank() -> None:
    start = time.monotonic()
    with pytest.raises(RanksFailed, match="deadline"):
        run_ranks(2, target="tests.dist.workers_smoke:sleep_forever", deadline=3)
    assert time.monotonic() - start < 20
