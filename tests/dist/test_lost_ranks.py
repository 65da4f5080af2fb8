"""Issue 3: the job survives losing ranks (rank 0 included) with warm reserves, on CPU/gloo.

Each test asserts the final state (world size, the reserve's ctx.rank), the number of restarts,
which initial ranks ran ``train()`` as which rank in each iteration, and which faults fired (from
``inprocess.faults``' record).
"""

from __future__ import annotations

import json
import signal
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from restartable.inprocess import faults as fi
from tests.multiproc import RankOutput, describe, run_job, run_ranks

TARGET = "tests.dist.workers_lost_ranks:train_with_faults"
FAST = {
    # Tight but safe on a shared 2-core machine: detection of a killed rank is event-driven and
    # does not depend on these; soft/hard timeouts only matter for the hang test.
    "soft_timeout": 20.0,
    "hard_timeout": 30.0,
    "heartbeat_interval": 0.1,
    "heartbeat_timeout": 5.0,
    "barrier_timeout": 30.0,
    "completion_timeout": 30.0,
    "termination_grace_time": 0.5,
    "max_iterations": 5,
}


class Job(NamedTuple):
    outs: list[RankOutput]
    active: dict[int, dict[int, int]]  # {iteration: {ctx.rank: initial rank}}
    fired: list[tuple[str, int, int, int, int | None]]  # see recorded()


def run(
    n: int,
    *,
    config: dict[str, Any],
    faults: list[dict[str, Any]],
    deadline: float = 60.0,
    **kwargs: Any,
) -> Job:
    """Run the job; return the outputs, who ran as which rank, and the faults that fired."""
    local_world_size = kwargs.pop("local_world_size", None)
    calls_dir = Path(tempfile.mkdtemp(prefix="lost-ranks-"))
    outs = run_ranks(
        n,
        target=TARGET,
        kwargs={
            "config": {**FAST, **config},
            "faults": faults,
            "calls_dir": str(calls_dir),
            **kwargs,
        },
        deadline=deadline,
        host_store=True,
        expect_success=False,
        local_world_size=local_world_size,
    )
    return Job(outs, active_per_iteration(calls_dir), recorded(calls_dir))


def active_per_iteration(calls_dir: Path) -> dict[int, dict[int, int]]:
    calls: dict[int, dict[int, int]] = defaultdict(dict)
    for path in sorted(calls_dir.glob("calls.*.jsonl")):
        for line in path.read_text().splitlines():
            c = json.loads(line)
            assert c["rank"] not in calls[c["iteration"]], f"two ranks ran as {c}"
            calls[c["iteration"]][c["rank"]] = c["initial_rank"]
    return dict(calls)


def recorded(calls_dir: Path) -> list[tuple[str, int, int, int, int | None]]:
    """The faults recorded in ``calls_dir``, oldest first: (kind, ctx.rank, initial rank,
    iteration, step)."""
    return [(f.kind, f.rank, f.initial_rank, f.iteration, f.step) for f in fi.fired(calls_dir)]


def finished(outs: list[RankOutput]) -> dict[int, dict[str, Any]]:
    """{initial rank: train's result} for the ranks that returned from the last iteration."""
    return {
        o.rank: o.result["result"]
        for o in outs
        if o.returncode == 0 and o.result and o.result["result"] is not None
    }


def check_exit(outs: list[RankOutput], expected: dict[int, int]) -> None:
    got = {o.rank: o.returncode for o in outs}
    assert got == expected, f"exit codes {got} != {expected}\n" + describe(outs)


def fault(kind: str, rank: int, *, iteration: int = 0, step: int = 1) -> dict[str, Any]:
    """Fault ``kind`` on training rank ``rank`` (ctx.rank) at ``step`` of ``iteration``."""
    return {"kind": kind, "rank": rank, "iteration": iteration, "step": step}


def test_sigkill_of_nonzero_rank_reserve_takes_its_place() -> None:
    outs, active, fired = run(3, config={"active_world_size": 2}, faults=[fault("kill", 1)])
    check_exit(outs, {0: 0, 1: -signal.SIGKILL, 2: 0})
    assert active == {0: {0: 0, 1: 1}, 1: {0: 0, 1: 2}}  # one restart; reserve 2 runs as rank 1
    assert fired == [("kill", 1, 1, 0, 1)]  # once: not again when reserve 2 replays step 1
    done = finished(outs)
    assert done[2] == {"iteration": 1, "rank": 1, "world_size": 2, "initial_rank": 2, "sum": 8.0}
    assert done[0]["rank"] == 0
    assert done[0]["world_size"] == 2


def test_sigkill_of_rank_zero_is_survived() -> None:
    outs, active, fired = run(3, config={"active_world_size": 2}, faults=[fault("kill", 0)])
    check_exit(outs, {0: -signal.SIGKILL, 1: 0, 2: 0})
    assert active == {0: {0: 0, 1: 1}, 1: {0: 2, 1: 1}}  # the reserve becomes rank 0
    assert fired == [("kill", 0, 0, 0, 1)]
    done = finished(outs)
    assert done[2]["rank"] == 0
    assert done[2]["world_size"] == 2
    assert done[1]["rank"] == 1
    assert done[1]["sum"] == 8.0


def test_gil_held_hang_is_killed_at_hard_timeout_and_replaced() -> None:
    outs, active, fired = run(
        3,
        config={"active_world_size": 2, "soft_timeout": 1.0, "hard_timeout": 3.0},
        faults=[fault("hang_gil", 1)],
        deadline=60,
    )
    # SIGTERM's default action ends the process even while its main thread holds the GIL.
    assert outs[1].returncode in (-signal.SIGTERM, -signal.SIGKILL), describe(outs)
    check_exit(outs, {0: 0, 1: outs[1].returncode or 0, 2: 0})
    assert active == {0: {0: 0, 1: 1}, 1: {0: 0, 1: 2}}
    assert fired == [("hang_gil", 1, 1, 0, 1)]  # recorded before the hang that got it killed
    assert finished(outs)[2]["rank"] == 1


def test_node_granularity_retires_the_whole_node() -> None:
    # 6 ranks on 3 simulated nodes {0,1} {2,3} {4,5}; 4 active, node 2 waits as the reserve.
    outs, active, fired = run(
        6,
        config={"active_world_size": 4, "granularity": "node"},
        faults=[fault("kill", 3)],
        local_world_size=2,
        deadline=100,
    )
    assert outs[3].returncode == -signal.SIGKILL, describe(outs)
    assert active[0] == {0: 0, 1: 1, 2: 2, 3: 3}
    # Node 1 leaves whole: its healthy rank 2 steps back, node 2 fills ranks 2 and 3.
    assert active[1] == {0: 0, 1: 1, 2: 4, 3: 5}
    assert set(active) == {0, 1}
    assert fired == [("kill", 3, 3, 0, 1)]
    done = finished(outs)
    assert {r: done[r]["rank"] for r in (0, 1, 4, 5)} == {0: 0, 1: 1, 4: 2, 5: 3}
    assert all(done[r]["world_size"] == 4 for r in (0, 1, 4, 5))
    # Healthy rank 2 stayed in the job as a reserve to the end: it exits cleanly, and its
    # train() returns None (the reserve's result), not a result of the last iteration.
    assert outs[2].returncode == 0, describe(outs)
    assert outs[2].result is not None and outs[2].result["result"] is None, describe(outs)


def test_reserves_exhausted_stop_with_one_clear_error_and_launcher_fails() -> None:
    # Rank 1 dies, reserve 2 takes over as rank 1 and dies too: 1 rank left,
    # min_active_world_size 2.
    # Through the project's launcher, which must report the failed job with a non-zero status.
    calls_dir = Path(tempfile.mkdtemp(prefix="lost-ranks-"))
    kwargs = {
        "config": {**FAST, "active_world_size": 2, "min_active_world_size": 2},
        "faults": [fault("kill", 1), fault("kill", 1, iteration=1)],
        "calls_dir": str(calls_dir),
    }
    job = run_job(
        [
            "-m",
            "restartable.launch",
            "--nproc-per-node",
            "3",
            "tests/dist/workers_lost_ranks.py",
            json.dumps(kwargs),
        ],
        deadline=60,
    )
    assert job.returncode != 0, job.output
    assert active_per_iteration(calls_dir) == {0: {0: 0, 1: 1}, 1: {0: 0, 1: 2}}
    assert recorded(calls_dir) == [("kill", 1, 1, 0, 1), ("kill", 1, 2, 1, 1)]
    # The survivor stops with one error naming the counts and the fix, not a hang.
    errors = [line for line in job.output.splitlines() if "RestartAbortedError: not enough" in line]
    assert len(errors) == 1, job.output
    assert errors[0].startswith("[rank 0]")
    assert "min_active_world_size is 2" in errors[0]
    assert "retired ranks [1, 2]" in errors[0]


def test_failing_user_health_check_retires_its_rank() -> None:
    # Rank 0 raises in iteration 0 (it stays); rank 1's health check fails after that iteration.
    outs, active, fired = run(
        3,
        config={"active_world_size": 2},
        faults=[fault("exception", 0)],
        unhealthy_after_iteration={"1": 0},
    )
    # One restart: the check runs before the restart decision, not at the next iteration's start.
    assert active == {0: {0: 0, 1: 1}, 1: {0: 0, 1: 2}}
    assert fired == [("exception", 0, 0, 0, 1)]
    done = finished(outs)
    assert done[0]["rank"] == 0
    assert done[2]["rank"] == 1
    assert done[2]["world_size"] == 2
    assert 1 not in done  # the unhealthy rank left the job (cleanly: exit 0)
    assert "simulated bad GPU" in outs[1].output
    assert all(o.returncode == 0 for o in outs), describe(outs)


pytestmark = pytest.mark.timeout(120)
