"""The restart protocol's cost does not grow with the job: one decider, constant calls per rank,
a compact decision, and the rare races that the re-check covers (docs/scale.md)."""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch.distributed as dist

from restartable.inprocess.config import RestartConfig
from restartable.inprocess.errors import FaultRecord, StoreTimeoutError
from restartable.inprocess.protocol import (
    barriers,
    fault_records,
    iteration_end,
    keys,
    restart_meeting,
)
from restartable.inprocess.protocol.policy import PUBLISHED_COLLATERAL, Decision, Observed, decide
from restartable.inprocess.protocol.ranks import (
    decode_ranks,
    encode_ranks,
    initial_assignment,
    node_of_ranks,
)
from restartable.inprocess.protocol.store import as_store
from tests.unit.test_inprocess_store import FakeClock, FakeStore


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(clock: FakeClock) -> FakeStore:
    return FakeStore(clock)


class Counted:
    """A store client of one rank that counts calls and the bytes of the values it reads."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.calls, self.read = inner, 0, 0

    def __getattr__(self, name: str) -> Callable[..., Any]:
        fn = getattr(self.inner, name)

        def call(*args: Any) -> Any:
            self.calls += 1
            out = fn(*args)
            self.read += len(out) if isinstance(out, bytes) else 0
            return out

        return call


def _restart(n: int) -> tuple[list[str], list[int], list[int], int]:
    """``n`` ranks (threads, one client each, a real in-memory torch store) restart after rank 1
    died: its report, then everyone's barrier. Returns the decisions, calls and bytes read per
    live rank, and how many ranks ran ``decide``."""
    raw = dist.HashStore()
    raw.set_timeout(datetime.timedelta(seconds=30))
    store = as_store(raw)
    restart_meeting.set_participants(store, 0, n)
    fault_records.report_fault(store, iteration=0, initial_rank=1, kind="dead", detail="killed")
    decided: list[int] = []
    assignment = initial_assignment(
        world_size=n,
        node_of=node_of_ranks(world_size=n, local_world_size=1),
        active_world_size=n - 1,
        granularity="rank",
    )

    def decide_(me: int, faults: list[FaultRecord]) -> str:
        decided.append(me)
        observed = Observed(iteration=0, faults=tuple(faults), gone=frozenset({1}))
        return decide(
            observed,
            history=[],
            assignment=assignment,
            target=n - 1,
            node_of=node_of_ranks(world_size=n, local_world_size=1),
            config=RestartConfig(),
        ).to_json()

    live = [r for r in range(n) if r != 1]
    # Counted under the C10dStore: each c10d call of the generic fast paths counts.
    counted = {r: Counted(raw) for r in live}
    clients = {r: as_store(counted[r]) for r in live}
    out: dict[int, str] = {}

    def rank(r: int) -> None:
        out[r] = restart_meeting.restart_barrier(
            clients[r],
            0,
            initial_rank=r,
            participants=range(n),
            decide=lambda faults: decide_(r, faults),
            timeout=30.0,
        )

    threads = [threading.Thread(target=rank, args=(r,)) for r in live]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    calls = [counted[r].calls for r in live]
    read = [counted[r].read for r in live]
    return [out[r] for r in live], calls, read, len(decided)


def test_many_ranks_one_decider_constant_calls_and_one_decision() -> None:
    small = _restart(64)
    large = _restart(128)
    for decisions, calls, _, deciders in (small, large):
        assert deciders == 1  # not one decision per rank: the rank that completed the count
        assert len(set(decisions)) == 1
        d = Decision.from_json(decisions[0])
        assert d.assignment is not None and 1 in d.assignment.retired
        # Only the last arrivals also wait for the count's completion (two calls more each;
        # the decider makes 6 too: its count, the claim, the fault records and the publish).
        assert sum(c == 6 for c in calls) <= restart_meeting.FULL_WATCHERS + 1
    # A waiter makes the same calls whatever N is (the decider a few more, to read the inputs):
    # two adds, then a wait and a get for the decision.
    assert sorted(small[1])[len(small[1]) // 2] == sorted(large[1])[len(large[1]) // 2] == 4
    # ... and reads no more bytes per rank at 128 ranks than at 64 (no list of every rank).
    assert max(large[2]) <= max(small[2]) + 64


def test_a_decider_that_dies_before_publishing_is_replaced_after_one_recheck(
    store: FakeStore, clock: FakeClock
) -> None:
    # Rank 2 completed the count (restart/full names it) and died before publishing.
    restart_meeting.set_participants(store, 0, 3)
    restart_meeting.count_once(store, 0, 0, expected=3, by="0")
    restart_meeting.count_once(store, 0, 1, expected=3, by="1")
    restart_meeting.count_once(store, 0, 2, expected=3, by="2")
    assert store.data[keys.iteration_prefix(0) + "restart/full"] == b"2"
    fault_records.report_fault(
        store, iteration=0, initial_rank=2, kind="dead", detail="killed deciding"
    )
    got = restart_meeting.restart_barrier(
        store,
        0,
        initial_rank=0,
        participants=[0, 1, 2],
        decide=lambda faults: f"{len(faults)} faults",
        timeout=60.0,
        clock=clock.clock(),
    )
    assert got == "1 faults"
    assert clock.now == 1000.0 + barriers.RECHECK_S


def test_a_participant_gone_in_an_earlier_iteration_is_counted_by_the_recheck(
    store: FakeStore, clock: FakeClock
) -> None:
    # Rank 2 died during the previous restart: its watchdog reported iteration 0, so nobody
    # counts it in iteration 1 but the waiter's re-check (the gone list is job-wide).
    fault_records.report_fault(store, iteration=0, initial_rank=2, kind="dead", detail="x")
    restart_meeting.set_participants(store, 1, 3)
    restart_meeting.count_once(store, 1, 1, expected=3, by="1")
    got = restart_meeting.restart_barrier(
        store,
        1,
        initial_rank=0,
        participants=[0, 1, 2],
        decide=lambda faults: "decided",
        timeout=60.0,
        clock=clock.clock(),
    )
    assert got == "decided"
    assert clock.now == 1000.0 + barriers.RECHECK_S


def test_a_waiter_that_times_out_raises_naming_the_barrier(
    store: FakeStore, clock: FakeClock
) -> None:
    restart_meeting.set_participants(store, 0, 3)
    with pytest.raises(StoreTimeoutError, match="restart barrier 0"):
        restart_meeting.restart_barrier(
            store,
            0,
            initial_rank=0,
            participants=[0, 1, 2],
            decide=lambda faults: "x",
            timeout=3.0,
            clock=clock.clock(),
        )


def test_peek_never_creates_the_key_nor_wakes_a_waiter() -> None:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False)
    woke: list[bytes] = []
    waiter = threading.Thread(
        target=lambda: woke.append(barriers.wait_value(as_store(server), "end", 5.0)), daemon=True
    )
    waiter.start()
    assert keys.peek(as_store(client), "end") is None
    assert not client.check(["end"])
    waiter.join(0.3)
    assert woke == []  # still waiting: a peek is not a write
    client.set("end", "fault")
    waiter.join(5)
    assert woke == [b"fault"] and keys.peek(as_store(client), "end") == b"fault"


def test_peek_takes_one_call_on_a_store_with_try_get(store: FakeStore) -> None:
    store.try_get = store.data.get  # type: ignore[attr-defined]
    store.set("k", "v")
    before = store.round_trips
    assert keys.peek(store, "k") == b"v" and keys.peek(store, "absent") is None
    assert store.round_trips == before  # only try_get, which the fake does not count


def test_record_fault_uses_a_stores_batch_when_it_has_one(
    store: FakeStore, clock: FakeClock
) -> None:
    batches: list[dict[str, Any]] = []

    def batch(*, append: list[tuple[str, str]], set_if_absent: list[tuple[str, str]]) -> None:
        batches.append({"append": append, "set_if_absent": set_if_absent})
        for k, v in append:
            store.append(k, v)
        for k, v in set_if_absent:
            store.compare_set(k, "", v)

    store.record_fault_batch = batch  # type: ignore[attr-defined]
    restart_meeting.set_participants(store, 0, 2)
    fault_records.report_fault(store, iteration=0, initial_rank=1, kind="exception", detail="x")
    assert len(batches) == 1  # an exception: one batch
    assert [k for k, _ in batches[0]["set_if_absent"]] == [
        keys.iteration_prefix(0) + k for k in ("end", "join/go", "ready/go")
    ]
    # A death: its records, its count at the restart barrier, then the end (two batches).
    fault_records.report_fault(store, iteration=0, initial_rank=1, kind="dead", detail="x")
    assert [len(b["append"]) for b in batches[1:]] == [2, 0]
    assert [len(b["set_if_absent"]) for b in batches[1:]] == [0, 3]
    assert iteration_end.outcome(store, 0) == keys.OUTCOME_FAULT and keys.gone_ranks(store) == {1}
    assert [f.initial_rank for f in fault_records.read_faults(store, 0)] == [1, 1]


@pytest.mark.parametrize(
    "ranks, text",
    [((), ""), ((5,), "5"), ((0, 1, 2, 3, 7, 5, 6), "0-3,7,5-6"), ((4, 3, 2), "4,3,2")],
)
def test_rank_runs_round_trip_in_order(ranks: tuple[int, ...], text: str) -> None:
    assert encode_ranks(ranks) == text
    assert decode_ranks(text) == ranks


def test_rank_runs_read_the_older_plain_list_and_reject_garbage() -> None:
    assert decode_ranks("1,2,3,") == (1, 2, 3)
    with pytest.raises(ValueError, match="'x'"):
        decode_ranks("1,x")
    with pytest.raises(ValueError, match="ends before it starts"):
        decode_ranks("5-2")


def test_reserves_are_published_as_runs(store: FakeStore) -> None:
    keys.set_reserves(store, 0, tuple(range(4000, 4096)))
    assert store.data[keys.iteration_prefix(0) + "reserves"] == b"4000-4095"
    assert keys.reserves(store, 0) == tuple(range(4000, 4096))


def test_the_published_decision_does_not_grow_with_the_job() -> None:
    def size(n: int) -> int:
        node_of = node_of_ranks(world_size=n, local_world_size=8)
        a = initial_assignment(
            world_size=n, node_of=node_of, active_world_size=n - n // 64, granularity="rank"
        )
        fault = FaultRecord(iteration=0, initial_rank=1, kind="dead", detail="x")
        d = decide(
            Observed(iteration=0, faults=(fault,), gone=frozenset({1})),
            history=[],
            assignment=a,
            target=len(a.active),
            node_of=node_of,
            config=RestartConfig(),
        )
        assert Decision.from_json(d.to_json()) == d
        return len(d.to_json())

    assert size(4096) <= size(64) + 16  # a few more digits, not a list of every rank


def test_a_published_decision_lists_a_bounded_number_of_collateral_faults() -> None:
    # An exception on rank 0 releases every blocked collective: each peer records a fault.
    n = 200
    node_of = node_of_ranks(world_size=n, local_world_size=8)
    a = initial_assignment(world_size=n, node_of=node_of, active_world_size=n, granularity="rank")
    own = FaultRecord(iteration=0, initial_rank=0, kind="exception", detail="ValueError: x")
    peers = tuple(
        FaultRecord(
            iteration=0,
            initial_rank=r,
            kind="exception",
            detail="Connection closed by peer",
            in_collective=True,
            after_fault=True,
        )
        for r in range(1, n)
    )
    d = decide(
        Observed(iteration=0, faults=(own, *peers)),
        history=[],
        assignment=a,
        target=n,
        node_of=node_of,
        config=RestartConfig(),
    )
    assert len(d.collateral) == n - 1
    published = Decision.from_json(d.to_json())
    assert published.counted == d.counted and published.assignment == d.assignment
    assert len(published.collateral) == PUBLISHED_COLLATERAL
    assert published.collateral_omitted == n - 1 - PUBLISHED_COLLATERAL
    assert f"and {n - 1 - PUBLISHED_COLLATERAL} more" in published.cause()
    assert len(d.to_json()) < 8000  # not ~200 fault records
