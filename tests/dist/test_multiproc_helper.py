"""The shared multi-process helper itself: results, surfaced tracebacks, deadlines."""

from __future__ import annotations

import signal
import time

import pytest

from tests import rank_zygote
from tests.multiproc import REPO_ROOT, RanksFailed, describe, run_ranks


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


def test_a_rank_starts_as_a_fresh_process_of_its_own_session() -> None:
    # Warm or cold (tests/rank_zygote.py): own session and group, the call's environment and
    # working directory, argv as `python -m tests._rank_main`, and a string-hash seed of its own
    # (ranks that iterate sets of strings in different orders must stay possible).
    name = "MULTIPROC_HELPER_PROBE"
    outs = run_ranks(
        3,
        target="tests.dist.workers_smoke:what_a_fresh_process_sees",
        kwargs={"env_name": name},
        env={name: "probe"},
        deadline=60,
    )
    seen = [o.result for o in outs]
    assert all(s["sid"] == s["pid"] == s["pgid"] for s in seen), seen
    assert all(s["env"] == "probe" and s["cwd"] == str(REPO_ROOT) for s in seen), seen
    assert all(s["argv0"] == str(REPO_ROOT / "tests" / "_rank_main.py") for s in seen), seen
    assert all(s["main"] == "__main__" for s in seen), seen
    assert len({s["hash"] for s in seen}) == 3, seen


def test_a_rank_killed_by_a_signal_reads_as_that_signal() -> None:
    outs = run_ranks(
        2, target="tests.dist.workers_smoke:kill_self", deadline=60, expect_success=False
    )
    assert [o.returncode for o in outs] == [-signal.SIGKILL] * 2, describe(outs)


def test_an_import_time_variable_of_its_own_starts_servers_for_it() -> None:
    # OMP_NUM_THREADS is read when torch loads: ranks that set another value must not be forked
    # from servers that loaded torch without it.
    outs = run_ranks(
        2,
        target="tests.dist.workers_smoke:what_a_fresh_process_sees",
        kwargs={"env_name": "OMP_NUM_THREADS"},
        env={"OMP_NUM_THREADS": "3"},
        deadline=60,
    )
    assert [o.result["env"] for o in outs] == ["3", "3"]
    assert rank_zygote.compatible({"OMP_NUM_THREADS": "1", "A": "1"}, {"A": "2"}) is False
    assert rank_zygote.compatible({"OMP_NUM_THREADS": "1", "A": "1"}, {"OMP_NUM_THREADS": "1"})
