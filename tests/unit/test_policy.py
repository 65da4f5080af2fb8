"""The restart policy (inprocess.protocol.policy.decide): every stop rule at its boundary,
collateral
classification, rank actions, node granularity, and properties over random fault sets."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from restartable.inprocess.config import RestartConfig
from restartable.inprocess.errors import FaultRecord
from restartable.inprocess.protocol.fault_evidence import classify, signature
from restartable.inprocess.protocol.policy import Decision, Observed, decide
from restartable.inprocess.protocol.ranks import Assignment, initial_assignment, node_of_ranks


def fault(rank: int, kind: str = "exception", *, it: int = 0, **kw: Any) -> FaultRecord:
    defaults: dict[str, Any] = {"detail": f"{kind} on {rank}", "time": 100.0 + rank}
    if kind == "exception":
        defaults.update(exc_type="builtins.RuntimeError", where="train.py:10", step=5)
    defaults.update(kw)
    return FaultRecord(iteration=it, initial_rank=rank, kind=kind, **defaults)


def start(world: int = 4, active: int | None = 3) -> Assignment:
    return initial_assignment(
        world_size=world, node_of=tuple(range(world)), active_world_size=active, granularity="rank"
    )


def run(
    faults: Sequence[FaultRecord],
    *,
    it: int = 0,
    gone: Sequence[int] = (),
    history: Sequence[Sequence[FaultRecord]] = (),
    assignment: Assignment | None = None,
    node_of: Sequence[int] | None = None,
    target: int | None = None,
    **options: Any,
) -> Decision:
    a = assignment or start()
    return decide(
        Observed(iteration=it, faults=tuple(faults), gone=frozenset(gone)),
        history=history,
        assignment=a,
        target=len(a.active) if target is None else target,
        node_of=node_of or tuple(range(len(a.active) + len(a.reserve) + len(a.retired))),
        config=RestartConfig(**options),
    )


# ----- the ordinary restart ------------------------------------------------------------------


def test_an_exception_restarts_with_the_same_ranks_and_blames_the_raiser() -> None:
    d = run([fault(1)])
    assert d.stop is None
    assert d.assignment == start()
    assert d.faulting_ranks == (1,)
    assert d.collateral == () and d.retired == () and d.demoted == ()
    assert d.cause() == "exception on rank 1"


def test_a_dead_rank_is_retired_and_the_first_reserve_takes_its_rank() -> None:
    d = run([fault(1, "dead")], gone=[1])
    assert d.assignment == Assignment(active=(0, 3, 2), reserve=(), retired=frozenset({1}))
    assert [(r.rank, r.reason) for r in d.retired] == [(1, "its process is gone")]


def test_a_gone_rank_that_is_not_a_participant_is_not_retired_again() -> None:
    a = Assignment(active=(0, 2), reserve=(), retired=frozenset({1}))
    d = run([fault(0)], gone=[1], assignment=a, node_of=(0, 1, 2))
    assert d.retired == () and d.assignment == a


def test_unhealthy_rank_is_retired_with_its_reason() -> None:
    d = run([fault(2, "unhealthy", detail="GPU 2 lost")])
    assert [(r.rank, r.reason) for r in d.retired] == [(2, "unhealthy: GPU 2 lost")]
    assert d.assignment is not None and 2 in d.assignment.retired


def test_exception_actions_demote_and_retire() -> None:
    demote = run([fault(0, action="demote")])
    assert demote.demoted == (0,)
    assert demote.assignment == Assignment(active=(3, 1, 2), reserve=(0,), retired=frozenset())
    retire = run([fault(0, action="retire")])
    assert [r.rank for r in retire.retired] == [0]
    assert retire.assignment == Assignment(active=(3, 1, 2), reserve=(), retired=frozenset({0}))


def test_a_rank_retired_and_asked_to_demote_is_only_retired() -> None:
    d = run([fault(1, action="demote")], gone=[1])
    assert d.demoted == () and [r.rank for r in d.retired] == [1]


def test_node_granularity_moves_the_healthy_node_mates_to_the_reserve_pool() -> None:
    nodes = node_of_ranks(world_size=6, local_world_size=2)  # (0, 0, 1, 1, 2, 2)
    a = initial_assignment(world_size=6, node_of=nodes, active_world_size=4, granularity="node")
    d = run([fault(1, "dead")], gone=[1], assignment=a, node_of=nodes, granularity="node")
    assert d.assignment == Assignment(active=(4, 5, 2, 3), reserve=(0,), retired=frozenset({1}))


# ----- stop rules, each at its boundary -------------------------------------------------------


def test_max_same_fault_stops_on_the_nth_identical_fault_in_a_row_not_before() -> None:
    same = [[fault(1, it=i)] for i in range(3)]
    assert run(same[2], it=2, history=same[:1], max_same_fault=3).stop is None
    d = run(same[2], it=2, history=same[:2], max_same_fault=3)
    assert d.stop is not None and d.assignment is None
    assert d.stop.startswith("the same fault repeated 3 times in a row (max_same_fault=3)")
    assert "rank 1 exception (step 5) at train.py:10" in d.stop


@pytest.mark.parametrize(
    "change", [{"step": 6}, {"where": "train.py:11"}, {"exc_type": "builtins.ValueError"}]
)
def test_max_same_fault_needs_the_same_type_place_and_step(change: dict[str, Any]) -> None:
    history = [[fault(1, it=0)], [fault(1, it=1)]]
    assert run([fault(1, it=2, **change)], it=2, history=history).stop is None


def test_the_same_bug_on_whichever_ranks_record_it_first_is_the_same_fault() -> None:
    # Every rank raises the same error; which of them records it before the restart interrupts
    # the others varies from one iteration to the next.
    history = [[fault(0, it=0), fault(2, it=0)], [fault(1, it=1)]]
    d = run([fault(2, it=2), fault(0, it=2, after_fault=True)], it=2, history=history)
    assert d.stop is not None and d.stop.startswith("the same fault repeated 3 times")


def test_max_same_fault_looks_at_the_latest_run_of_a_longer_history() -> None:
    history = [[fault(2, it=0)], [fault(1, it=1)], [fault(1, it=2)]]
    assert run([fault(1, it=3)], it=3, history=history).stop is not None
    history = [[fault(1, it=i)] for i in range(3)]
    assert run([fault(1, it=3)], it=3, history=history).stop is not None


def test_max_same_fault_one_stops_at_the_first_fault_and_an_interruption_resets_the_run() -> None:
    assert run([fault(1)], max_same_fault=1).stop is not None
    history = [[fault(1, it=0)], [fault(1, it=1, step=7)]]
    assert run([fault(1, it=2)], it=2, history=history, max_same_fault=2).stop is None


def test_faults_without_an_own_fault_never_trigger_the_repeated_fault_stop() -> None:
    history = [[fault(1, "dead", it=0)], [fault(1, "dead", it=1)]]
    assert signature(history[0]) == ()
    a = start(world=6, active=3)
    assert run([fault(1, "dead", it=2)], it=2, gone=[1], history=history, assignment=a).stop is None


def test_max_iterations_stops_when_the_last_allowed_call_faulted() -> None:
    assert run([fault(0)], it=2, max_iterations=4).stop is None
    d = run([fault(0)], it=3, max_iterations=4)
    assert d.stop is not None and d.stop.startswith("max_iterations (4) reached: train() ran 4")


def test_not_enough_ranks_stops_naming_min_active_world_size() -> None:
    a = start(world=3, active=3)
    assert run([fault(2, "dead")], gone=[2], assignment=a, min_active_world_size=2).stop is None
    d = run([fault(2, "dead")], gone=[2], assignment=a, min_active_world_size=3)
    assert d.stop is not None and d.assignment is None
    assert d.stop.startswith("not enough healthy ranks to continue: only 2 healthy rank(s)")
    assert "min_active_world_size is 3" in d.stop


def test_the_last_rank_lost_stops_the_job() -> None:
    a = Assignment(active=(0,), reserve=(), retired=frozenset({1}))
    d = run([fault(0, "hard_timeout")], gone=[0], assignment=a, node_of=(0, 1))
    assert d.stop is not None and "only 0 healthy rank(s)" in d.stop


def test_the_job_shrinks_when_reserves_run_out_down_to_the_minimum() -> None:
    a = start(world=3, active=3)
    d = run([fault(1, "dead")], gone=[1], assignment=a)
    assert d.assignment == Assignment(active=(0, 2), reserve=(), retired=frozenset({1}))


def test_max_rank_faults_retires_a_rank_after_more_faulting_iterations_than_allowed() -> None:
    history = [[fault(1, it=0, step=1)]]
    kept = run([fault(1, it=1, step=2)], it=1, history=history[:0], max_rank_faults=1)
    assert kept.retired == ()
    d = run([fault(1, it=1, step=2)], it=1, history=history, max_rank_faults=1)
    assert [(r.rank, r.reason) for r in d.retired] == [
        (1, "faulted in 2 iterations (max_rank_faults=1)")
    ]
    assert d.assignment == Assignment(active=(0, 3, 2), reserve=(), retired=frozenset({1}))
    assert run([fault(1, it=1, step=2)], it=1, history=history).retired == ()  # None: never


def test_a_rank_retired_earlier_is_not_retired_again_by_its_old_faults() -> None:
    history = [[fault(1, it=0)], [fault(1, it=1, step=6)]]
    a = Assignment(active=(0, 3, 2), reserve=(), retired=frozenset({1}))
    d = run([fault(0, it=2, step=7)], it=2, history=history, assignment=a, max_rank_faults=1)
    assert d.retired == () and d.assignment == a


def test_max_rank_faults_counts_soft_timeouts_but_not_collateral_faults() -> None:
    history = [[fault(2, "soft_timeout", it=0)]]
    d = run([fault(2, "soft_timeout", it=1)], it=1, history=history, max_rank_faults=1)
    assert [r.rank for r in d.retired] == [2]
    # Rank 0 was collateral in iteration 0 (not in the counted history): not retired now.
    counted0, _ = classify(
        [fault(1, it=0), fault(0, it=0, in_collective=True, detail="Connection closed by peer")]
    )
    assert [f.initial_rank for f in counted0] == [1]
    d = run([fault(0, it=1, step=9)], it=1, history=[counted0], max_rank_faults=1)
    assert d.retired == ()


def test_stop_rules_are_checked_in_order_repeated_fault_first() -> None:
    history = [[fault(1, it=0)], [fault(1, it=1)]]
    d = run([fault(1, it=2)], it=2, history=history, max_iterations=3)
    assert d.stop is not None and d.stop.startswith("the same fault repeated")


# ----- collateral faults ----------------------------------------------------------------------

PEER_CLOSED = "RuntimeError: [pair.cc:537] Read error: Connection closed by peer"


def test_the_issue_case_a_killed_rank_and_its_survivor_whose_collective_broke_first() -> None:
    # Rank 0's all-reduce failed before the watchdog reported rank 1's death: the survivor's
    # record arrived first, and it is still not blamed.
    survivor = fault(0, detail=PEER_CLOSED, in_collective=True, time=1.0)
    d = run([survivor, fault(1, "dead", time=2.0)], gone=[1])
    assert d.faulting_ranks == (1,)
    assert [c.fault.initial_rank for c in d.collateral] == [0]
    assert d.collateral[0].reason == "raised by a collective, after dead on rank 1, rank 1 gone"
    assert d.cause() == "dead on rank 1 (collateral, not counted: rank(s) 0)"


def test_after_the_iteration_faulted_only_a_failed_collective_is_collateral() -> None:
    own = run([fault(1), fault(0, after_fault=True, detail="ValueError: a bug of rank 0's own")])
    assert own.faulting_ranks == (0, 1) and own.collateral == ()
    # The record that ended the iteration may not be in the store yet when the policy reads it.
    broken = run([fault(0, after_fault=True, in_collective=True)])
    assert broken.faulting_ranks == ()
    assert broken.collateral[0].reason == (
        "raised by a collective, after the iteration had already faulted"
    )


def test_a_collective_failure_after_a_peer_hung_is_collateral() -> None:
    d = run([fault(2, "soft_timeout"), fault(0, in_collective=True, detail="timeout")])
    assert d.faulting_ranks == (2,)
    assert d.collateral[0].reason == "raised by a collective, after soft_timeout on rank 2"


def test_a_collective_failure_with_nobody_else_to_blame_counts() -> None:
    d = run([fault(0, in_collective=True), fault(1, in_collective=True)])
    assert d.faulting_ranks == (0, 1) and d.collateral == ()


def test_message_matching_is_the_last_resort_and_named_as_such() -> None:
    d = run([fault(1), fault(0, detail=PEER_CLOSED)])
    assert d.faulting_ranks == (1,)
    assert d.collateral[0].reason.startswith(
        "message contains 'Connection closed by peer' (last resort: no structural evidence)"
    )
    both = run([fault(1, detail=PEER_CLOSED), fault(0, detail=PEER_CLOSED)])
    assert both.faulting_ranks == (0, 1)


def test_a_rank_is_never_collateral_to_its_own_fault() -> None:
    d = run([fault(0, "soft_timeout"), fault(0, in_collective=True)])
    assert d.faulting_ranks == (0,) and d.collateral == ()


def test_timeouts_and_deaths_are_never_collateral() -> None:
    d = run([fault(1), fault(2, "soft_timeout", detail=PEER_CLOSED)])
    assert d.faulting_ranks == (1, 2)


def test_decision_json_round_trips_with_collateral_and_stop() -> None:
    d = run([fault(0, in_collective=True), fault(1, "dead")], gone=[1])
    assert Decision.from_json(d.to_json()) == d
    stopped = run([fault(1)], max_same_fault=1)
    assert Decision.from_json(stopped.to_json()) == stopped


# ----- properties -----------------------------------------------------------------------------

KINDS = ("exception", "soft_timeout", "dead", "hard_timeout", "unhealthy", "completion_timeout")


@st.composite
def scenarios(draw: st.DrawFn) -> dict[str, Any]:
    local = draw(st.sampled_from([1, 2]))
    world = local * draw(st.integers(1, 4))
    node_of = node_of_ranks(world_size=world, local_world_size=local)
    granularity = draw(st.sampled_from(["rank", "node"]))
    active = draw(st.integers(1, world))
    a = initial_assignment(
        world_size=world, node_of=node_of, active_world_size=active, granularity=granularity
    )
    records = draw(
        st.lists(
            st.builds(
                fault,
                st.integers(0, world - 1),
                st.sampled_from(KINDS),
                step=st.integers(0, 3),
                in_collective=st.booleans(),
                after_fault=st.booleans(),
                action=st.sampled_from(["", "", "demote", "retire"]),
                detail=st.sampled_from(["boom", PEER_CLOSED]),
            ),
            max_size=6,
        )
    )
    gone = draw(st.sets(st.integers(0, world - 1), max_size=world))
    return {
        "faults": records,
        "gone": sorted(gone),
        "assignment": a,
        "node_of": node_of,
        "granularity": granularity,
        "max_rank_faults": draw(st.sampled_from([None, 1, 2])),
        "min_active_world_size": draw(st.integers(1, active)),
    }


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_properties_of_every_decision(s: dict[str, Any]) -> None:
    d = run(**s)
    assert sorted(map(repr, d.faults)) == sorted(map(repr, s["faults"]))  # each counted once
    assert d == run(**s)  # deterministic: any rank computes the same decision
    assert Decision.from_json(d.to_json()) == d
    a: Assignment = s["assignment"]
    participants = set(a.active) | set(a.reserve)
    retired_now = {r.rank for r in d.retired}
    assert set(s["gone"]) & participants <= retired_now <= participants
    assert all(c.fault.kind == "exception" for c in d.collateral)
    if d.stop is not None:
        assert d.assignment is None
        return
    new = d.assignment
    assert new is not None
    world = len(s["node_of"])
    everyone = [*new.active, *new.reserve, *new.retired]
    assert sorted(everyone) == list(range(world))  # every rank in exactly one role
    assert retired_now <= new.retired and not (set(new.active) & retired_now)
    assert s["min_active_world_size"] <= len(new.active) <= len(a.active)


def test_a_repeated_exception_of_the_code_stops_as_an_application_fault() -> None:
    # The launcher ends such a job with EXIT_APPLICATION instead of restarting or requeueing it.
    same = [[fault(1, it=i)] for i in range(3)]
    d = run(same[2], it=2, history=same[:2], max_same_fault=3)
    assert d.stop_origin == "application"
    assert Decision.from_json(d.to_json()).stop_origin == "application"
    # A repeated hang, or an exception that names a storage or GPU error, may be the machine's.
    hangs = [[fault(1, "soft_timeout", it=i, step=5)] for i in range(3)]
    assert run(hangs[2], it=2, history=hangs[:2], max_same_fault=3).stop_origin == ""
    disk = [[fault(1, it=i, detail="OSError: [Errno 28] No space left on device")]
            for i in range(3)]  # fmt: skip
    assert run(disk[2], it=2, history=disk[:2], max_same_fault=3).stop_origin == ""
    # Other stops have no origin.
    assert run([fault(1, it=1)], it=1, max_iterations=2).stop_origin == ""
