"""The restart side of replacing a straggler: ``inprocess.restart.demotion`` records a swap only
when a
warm reserve is free, and the pure policy grants a swap only while a reserve can take the place
(and does not count it as the rank's fault)."""

from __future__ import annotations

import time
from typing import Any

import pytest
from torch.distributed import PrefixStore, TCPStore

from restartable.inprocess.config import RestartConfig
from restartable.inprocess.context import RestartContext
from restartable.inprocess.errors import FaultRecord
from restartable.inprocess.protocol import fault_records, iteration_end, keys
from restartable.inprocess.protocol.policy import Observed, decide
from restartable.inprocess.protocol.ranks import Assignment
from restartable.inprocess.protocol.store import as_store
from restartable.inprocess.restart.demotion import STRAGGLER_KIND, free_reserves, replace_rank


def swap(rank: int, *, it: int = 0) -> FaultRecord:
    return FaultRecord(
        iteration=it, initial_rank=rank, kind=STRAGGLER_KIND, detail="slow", action="demote"
    )


def decide_on(
    faults: list[FaultRecord], assignment: Assignment, *, gone: frozenset[int] = frozenset(),
    history: list[list[FaultRecord]] | None = None, **options: Any,
) -> Any:  # fmt: skip
    world = len(assignment.active) + len(assignment.reserve) + len(assignment.retired)
    return decide(
        Observed(iteration=0, faults=tuple(faults), gone=gone),
        history=history or [],
        assignment=assignment,
        target=len(assignment.active),
        node_of=tuple(range(world)),
        config=RestartConfig(**options),
    )


def test_a_swap_with_a_reserve_puts_the_reserve_in_the_straggler_place() -> None:
    d = decide_on([swap(1)], Assignment(active=(0, 1), reserve=(2,), retired=frozenset()))
    assert d.stop is None and d.demoted == (1,) and d.retired == ()
    assert d.assignment == Assignment(active=(0, 2), reserve=(1,), retired=frozenset())
    assert d.cause() == "straggler on rank 1"


def test_a_swap_without_a_free_reserve_is_not_granted() -> None:
    d = decide_on([swap(1)], Assignment(active=(0, 1), reserve=(), retired=frozenset()))
    assert d.demoted == () and d.assignment is not None and d.assignment.active == (0, 1)
    # The only reserve replaces a dead active rank first: nothing is left for the swap.
    dead = FaultRecord(iteration=0, initial_rank=0, kind="dead", detail="killed")
    d = decide_on(
        [swap(1), dead],
        Assignment(active=(0, 1), reserve=(2,), retired=frozenset()),
        gone=frozenset({0}),
    )
    assert d.demoted == () and d.assignment is not None and set(d.assignment.active) == {1, 2}


def test_swaps_are_not_the_rank_own_faults() -> None:
    a = Assignment(active=(0, 1), reserve=(2, 3), retired=frozenset())
    earlier = [[swap(1, it=0)], [swap(1, it=1)]]
    d = decide_on([swap(1, it=2)], a, history=earlier, max_rank_faults=1, max_same_fault=2)
    # max_rank_faults and the repeated-fault stop count a rank's own faults only.
    assert d.stop is None and d.retired == () and d.demoted == (1,)


@pytest.fixture
def job_store() -> Any:
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def ctx_on(store: Any, *, rank: int = 1, iteration: int = 0) -> RestartContext:
    """Rank ``rank`` of two active ranks (initial ranks 0 and 1) in ``iteration``."""
    return RestartContext(
        iteration=iteration,
        rank=rank,
        world_size=2,
        initial_rank=rank,
        active_ranks=(0, 1),
        store=PrefixStore(keys.pg_prefix(iteration) + "/user", store),
        last_restart=None,
        _progress=None,  # type: ignore[arg-type]  # not used by replace_rank
        _interrupter=None,  # type: ignore[arg-type]
        step=42,
    )


def test_the_slow_rank_records_a_swap_that_ends_the_iteration(job_store: Any) -> None:
    keys.set_reserves(as_store(job_store), 0, (2,))
    # wait=0: no restart loop here to interrupt the wait.
    assert replace_rank(ctx_on(job_store), 1, reason="relative 0.33", tag="t1", wait=0.0)
    (record,) = fault_records.read_faults(as_store(job_store), 0)
    assert (record.kind, record.initial_rank, record.action, record.step) == (
        "straggler",
        1,
        "demote",
        42,
    )
    assert (
        iteration_end.outcome(as_store(job_store), 0) == keys.OUTCOME_FAULT
    )  # every rank's monitor wakes
    # A peer gets the same answer from the slow rank's decision.
    assert replace_rank(ctx_on(job_store, rank=0), 1, reason="x", tag="t1", wait=0.5)


def test_without_a_live_reserve_every_rank_gets_false_and_nothing_is_recorded(
    job_store: Any,
) -> None:
    slow, peer = ctx_on(job_store), ctx_on(job_store, rank=0)
    assert slow.replace_rank(1, reason="slow", tag="t1") is False  # no reserve at all
    assert peer.replace_rank(1, reason="slow", tag="t1") is False
    keys.set_reserves(as_store(job_store), 0, (2,))
    fault_records.report_fault(
        as_store(job_store), iteration=0, initial_rank=2, kind="dead", detail="gone"
    )
    assert free_reserves(as_store(job_store), 0) == ()
    assert replace_rank(slow, 1, reason="slow", tag="t2") is False
    assert [f.kind for f in fault_records.read_faults(as_store(job_store), 0)] == ["dead"]


def test_a_peer_does_not_wait_forever_for_a_decision(job_store: Any) -> None:
    t0 = time.monotonic()
    assert replace_rank(ctx_on(job_store, rank=0), 1, reason="x", tag="never", wait=0.3) is False
    assert time.monotonic() - t0 < 5.0


def test_replace_rank_checks_its_input(job_store: Any) -> None:
    with pytest.raises(ValueError, match=r"rank \(2\) must be a training rank .* \(0..1\)"):
        replace_rank(ctx_on(job_store), 2, reason="x", tag="t")
    ctx = ctx_on(job_store)
    ctx.store = {}
    with pytest.raises(RuntimeError, match="needs the restart context that @restartable built"):
        replace_rank(ctx, 1, reason="slow", tag="t")
