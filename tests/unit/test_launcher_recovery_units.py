"""Issue 14, single process: the autoresume flag, the restart-or-end rule, the launcher's flag
checks, and the admission of a respawned process on an in-memory store (HashStore)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch.distributed as dist

from restartable.inprocess.errors import RestartAbortedError
from restartable.inprocess.launch import autoresume
from restartable.inprocess.launch.actions import restart_or_end
from restartable.inprocess.launch.cli import parse_args
from restartable.inprocess.launch.rank_env import rank_env
from restartable.inprocess.protocol import job_keys, keys
from restartable.inprocess.protocol.policy import Decision
from restartable.inprocess.protocol.ranks import Assignment
from restartable.inprocess.protocol.store import as_store


def test_flag_written_for_requeue_while_retries_remain(tmp_path: Path) -> None:
    flag = tmp_path / "f.json"
    assert autoresume.settle(str(flag), status=75, reason="node gone", attempt=1, max_retries=2)
    data = json.loads(flag.read_text())
    assert (data["status"], data["attempt"], data["retries_left"]) == (75, 1, 0)
    assert autoresume.attempt_number(str(flag), environ={}) == 2  # the next attempt
    assert autoresume.attempt_number(str(flag), environ={"SLURM_RESTART_COUNT": "5"}) == 5
    # No retry left: the stale flag goes, the job is not requeued again.
    assert not autoresume.settle(str(flag), status=75, reason="x", attempt=2, max_retries=2)
    assert not flag.exists()


@pytest.mark.parametrize("status", [0, 17, 1])
def test_finished_or_invalid_job_removes_the_flag(tmp_path: Path, status: int) -> None:
    flag = tmp_path / "f.json"
    flag.write_text("{}")
    assert not autoresume.settle(str(flag), status=status, reason="r", attempt=0, max_retries=2)
    assert not flag.exists()


def test_restart_while_budget_lasts_then_requeue() -> None:
    assert restart_or_end(0, max_restarts=2, reason="r").kind == "restart"
    assert restart_or_end(1, max_restarts=2, reason="r").kind == "restart"
    end = restart_or_end(2, max_restarts=2, reason="stopped")
    assert (end.kind, end.status) == ("end", autoresume.EXIT_REQUEUE)
    assert "in-job restarts exhausted (2 of --max-restarts 2)" in end.reason
    assert restart_or_end(0, max_restarts=0, reason="r").kind == "end"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-respawns", "-1"], "--max-respawns (-1) must be >= 0"),
        (["--max-restarts", "-2"], "--max-restarts (-2) must be >= 0"),
        (["--monitor-interval", "0"], "--monitor-interval (0.0) must be > 0"),
        (["--simulated-fault-rank", "5"], "--simulated-fault-rank (5) must be in [0, 2)"),
    ],
)
def test_bad_launcher_flags_name_the_flag_and_value(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--nproc-per-node", "2", *flags, "train.py"])
    assert message in capsys.readouterr().err


def test_restart_by_node_is_the_default_also_on_etcd() -> None:
    """Issue 52: a plain launch restarts by node (on the TCPStore and on etcd: the relay opens
    an etcd client of its own); --restart-by rank still chooses the per-rank path."""
    for store in ([], ["--store", "etcd://h:2379"]):
        assert parse_args(["--nproc-per-node", "2", *store, "t.py"]).restart_by == "node"
        args = parse_args(["--nproc-per-node", "2", "--restart-by", "rank", *store, "t.py"])
        assert args.restart_by == "rank"


def test_restart_by_rank_above_the_node_barriers_slots(capsys: pytest.CaptureFixture[str]) -> None:
    """A node of more processes than the node barrier counts (a CPU job of 32 ranks a node)
    restarts by rank without being asked; asking for node there names both flags."""
    assert parse_args(["--nproc-per-node", "32", "t.py"]).restart_by == "rank"
    assert parse_args(["--nproc-per-node", "31", "t.py"]).restart_by == "node"
    with pytest.raises(SystemExit):
        parse_args(["--nproc-per-node", "32", "--restart-by", "node", "t.py"])
    assert "--restart-by node with --nproc-per-node 32" in capsys.readouterr().err


def test_respawned_process_keeps_its_slot_rank_and_gets_a_generation() -> None:
    args = parse_args(["--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "1", "t.py"])
    env = rank_env(args, 1, 1234, generation=2)
    assert (env["RANK"], env["WORLD_SIZE"], env["INPROCESS_RESPAWN_GENERATION"]) == ("3", "4", "2")
    assert "INPROCESS_RESPAWN_GENERATION" not in rank_env(args, 1, 1234)


def _decision(iteration: int, active: tuple[int, ...], reserve: tuple[int, ...]) -> str:
    a = Assignment(active=active, reserve=reserve, retired=frozenset())
    return Decision(iteration, (), (), (), (), a, None).to_json()


def test_joiner_is_admitted_by_the_next_decision_that_names_it() -> None:
    store = as_store(dist.HashStore())
    store.set(keys.ROOT + "init/go", "ok")
    job_keys.start_iteration(store, 1, participants=1, reserves=())
    since = job_keys.current_iteration(store)
    job_keys.register_joiner(store, 5)
    assert job_keys.ready_joiners(store) == {5}
    got: list[job_keys.Admission | None] = []
    t = threading.Thread(
        target=lambda: got.append(
            job_keys.wait_admission(store, identity=5, decision_timeout=5, since=since)
        )
    )
    t.start()
    # Iteration 1 faults; its decision was taken before 5 registered; iteration 2's admits it.
    store.set(keys.iteration_prefix(0) + "restart/go", _decision(0, (0, 3), ()))
    store.set(keys.end_key(1), keys.OUTCOME_FAULT)
    store.set(keys.iteration_prefix(1) + "restart/go", _decision(1, (0, 3), ()))
    store.set(keys.end_key(2), keys.OUTCOME_FAULT)
    store.set(keys.iteration_prefix(2) + "restart/go", _decision(2, (0, 3), (5,)))
    t.join(10)
    admitted = got[0]
    assert admitted is not None
    assert (admitted.iteration, admitted.assignment.reserve) == (3, (5,))
    assert [d.iteration for d in admitted.decisions] == [0, 1, 2]  # the shared history
    job_keys.mark_gone(store, 5)
    assert job_keys.ready_joiners(store) == set()


def test_an_admission_decided_before_the_joiner_waits_is_not_missed() -> None:
    """Found by the four-kills launcher test: the respawned process registered, the restart
    admitted it and the ranks announced the next iteration, all before it started waiting.
    Reading the iteration only then, it waited on the iteration that waits for it."""
    store = as_store(dist.HashStore())
    store.set(keys.iteration_prefix(0) + "restart/go", _decision(0, (0, 1, 2), ()))
    job_keys.start_iteration(store, 1, participants=3, reserves=())
    since = job_keys.current_iteration(store)  # read before registering, as the wrapper does
    job_keys.register_joiner(store, 5)
    store.set(keys.end_key(1), keys.OUTCOME_FAULT)
    store.set(keys.iteration_prefix(1) + "restart/go", _decision(1, (0, 5, 2), ()))
    job_keys.start_iteration(store, 2, participants=3, reserves=())  # iteration 2 waits for 5
    admitted = job_keys.wait_admission(store, identity=5, decision_timeout=1, since=since)
    assert admitted is not None
    assert (admitted.iteration, admitted.assignment.active) == (2, (0, 5, 2))
    assert [d.iteration for d in admitted.decisions] == [0, 1]


def test_joiner_leaves_when_the_job_finishes_or_stops() -> None:
    store = as_store(dist.HashStore())
    job_keys.start_iteration(store, 0, participants=1, reserves=())
    store.set(keys.end_key(0), keys.OUTCOME_DONE)
    assert job_keys.wait_admission(store, identity=5, decision_timeout=1, since=0) is None
    store = as_store(dist.HashStore())
    store.set(keys.end_key(0), keys.OUTCOME_FAULT)
    stop = Decision(0, (), (), (), (), None, "not enough healthy ranks").to_json()
    store.set(keys.iteration_prefix(0) + "restart/go", stop)
    with pytest.raises(RestartAbortedError, match="not enough healthy ranks"):
        job_keys.wait_admission(store, identity=5, decision_timeout=1, since=0)


def test_job_state_tells_the_launcher_what_the_ranks_did() -> None:
    store = as_store(dist.HashStore())
    assert job_keys.job_state(store) == job_keys.JOB_NOT_STARTED
    store.set(keys.ROOT + "init/go", "ok")
    job_keys.start_iteration(store, 2, participants=1, reserves=())
    assert job_keys.job_state(store) == job_keys.JOB_RUNNING
    store.set(keys.end_key(2), keys.OUTCOME_DONE)
    assert job_keys.job_state(store) == job_keys.JOB_DONE
    job_keys.mark_stopped(store, "max_iterations (1) reached")
    job_keys.mark_stopped(store, "a later reason")  # first writer wins
    assert job_keys.job_state(store) == job_keys.JOB_STOPPED
    assert job_keys.stop_reason(store) == "max_iterations (1) reached"
