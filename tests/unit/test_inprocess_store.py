"""The store protocol (keys, barriers, fault records) with a fake store and a fake clock."""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable

import pytest

from restartable.inprocess.clock import SYSTEM
from restartable.inprocess.errors import FaultRecord, StoreTimeoutError
from restartable.inprocess.protocol import (
    barriers,
    fault_records,
    iteration_end,
    keys,
    restart_meeting,
)
from restartable.inprocess.protocol.store import StoreBase
from tests.fake_clock import FakeClock


class FakeStore(StoreBase):
    """A dict with the c10d calls the protocol uses (the fast paths: ``StoreBase``'s generic
    ones, as on a TCPStore); ``wait`` on a missing key first runs the next scripted event (what
    other ranks do meanwhile), else advances the fake clock by the timeout and raises the
    timeout error c10d raises."""

    def __init__(self, clock: FakeClock) -> None:
        self.data: dict[str, bytes] = {}
        self.clock = clock
        self.events: list[Callable[[], None]] = []
        self.round_trips = 0

    def set(self, key: str, value: str | bytes) -> None:
        self.round_trips += 1
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key: str) -> bytes:
        self.round_trips += 1
        return self.data[key]

    def add(self, key: str, value: int) -> int:
        self.round_trips += 1
        n = int(self.data.get(key, b"0")) + value
        self.data[key] = str(n).encode()
        return n

    def append(self, key: str, value: str | bytes) -> None:
        self.round_trips += 1
        v = value.encode() if isinstance(value, str) else value
        self.data[key] = self.data.get(key, b"") + v

    def compare_set(self, key: str, expected_value: str, desired_value: str) -> bytes:
        self.round_trips += 1
        current = self.data.get(key)
        if (current is None and expected_value == "") or current == expected_value.encode():
            self.data[key] = desired_value.encode()
        elif current is None:  # c10d: an absent key and a non-empty expected value
            return expected_value.encode()
        return self.data[key]

    def check(self, keys_: list[str]) -> bool:
        self.round_trips += 1
        return all(k in self.data for k in keys_)

    def wait(self, keys_: list[str], timeout: datetime.timedelta) -> None:
        self.round_trips += 1
        while not all(k in self.data for k in keys_):
            if self.events:
                self.events.pop(0)()
                continue
            self.clock.now += timeout.total_seconds()
            raise RuntimeError(f"wait timeout after {timeout}")


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(clock: FakeClock) -> FakeStore:
    return FakeStore(clock)


def test_report_fault_ends_the_iteration_and_breaks_its_barriers(store: FakeStore) -> None:
    fault_records.report_fault(store, iteration=3, initial_rank=2, kind="exception", detail="boom")
    assert iteration_end.outcome(store, 3) == keys.OUTCOME_FAULT
    assert (
        iteration_end.outcome(store, 2) is None and iteration_end.outcome(store, 4) is None
    )  # own namespace
    assert not barriers.join_barrier(store, 3, expected=4, timeout=1.0, clock=SYSTEM)
    assert not barriers.ready_barrier(store, 3, expected=4, timeout=1.0, clock=SYSTEM)
    (record,) = fault_records.read_faults(store, 3)
    assert (record.initial_rank, record.kind, record.detail) == (2, "exception", "boom")


def test_repeated_reports_keep_one_outcome_and_every_record(store: FakeStore) -> None:
    fault_records.report_fault(store, iteration=0, initial_rank=1, kind="dead", detail="a")
    fault_records.report_fault(store, iteration=0, initial_rank=1, kind="dead", detail="a")
    iteration_end.mark_completed(store, 0, active=1)  # a late completion cannot turn it into "done"
    assert iteration_end.outcome(store, 0) == keys.OUTCOME_FAULT
    assert len(fault_records.read_faults(store, 0)) == 2
    assert keys.gone_ranks(store) == {1}


def test_completion_of_every_active_rank_ends_it_done(store: FakeStore) -> None:
    iteration_end.mark_completed(store, 0, active=2)
    assert iteration_end.outcome(store, 0) is None
    iteration_end.mark_completed(store, 0, active=2)
    assert iteration_end.outcome(store, 0) == keys.OUTCOME_DONE
    fault_records.report_fault(
        store, iteration=0, initial_rank=0, kind="dead", detail="after the end"
    )
    assert iteration_end.outcome(store, 0) == keys.OUTCOME_DONE


def test_barrier_is_two_round_trips_for_the_last_arrival(store: FakeStore) -> None:
    store.add("b/n", 2)  # two ranks already there
    before = store.round_trips
    assert barriers.counting_barrier(store, "b", expected=3, timeout=5.0) == "ok"
    assert store.round_trips - before <= 4  # add, compare_set, wait, get


def test_barrier_waits_for_the_others(store: FakeStore, clock: FakeClock) -> None:
    def others_arrive() -> None:
        for _ in range(2):
            if store.add("b/n", 1) >= 3:
                store.compare_set("b/go", "", "ok")

    store.events.append(others_arrive)
    assert (
        barriers.counting_barrier(store, "b", expected=3, timeout=5.0, clock=clock.clock()) == "ok"
    )
    assert clock.now == 1000.0  # released without a timeout


def test_barrier_times_out_on_the_fake_clock(store: FakeStore, clock: FakeClock) -> None:
    t0 = time.monotonic()
    with pytest.raises(StoreTimeoutError, match="'b' did not complete"):
        barriers.counting_barrier(store, "b", expected=2, timeout=30.0, clock=clock.clock())
    assert clock.now >= 1030.0
    assert time.monotonic() - t0 < 1.0  # no real waiting


def test_a_fault_during_the_join_wait_breaks_it(store: FakeStore, clock: FakeClock) -> None:
    store.events.append(
        lambda: fault_records.report_fault(
            store, iteration=0, initial_rank=1, kind="dead", detail="x"
        )
    )
    assert not barriers.join_barrier(store, 0, expected=2, timeout=5.0, clock=clock.clock())


def test_restart_barrier_does_not_wait_for_gone_ranks(store: FakeStore) -> None:
    restart_meeting.set_participants(store, 0, 3)
    fault_records.report_fault(
        store, iteration=0, initial_rank=2, kind="hard_timeout", detail="killed"
    )
    calls: list[int] = []

    def decide(faults: list[FaultRecord]) -> str:
        calls.append(len(faults))
        return "decision"

    # Rank 1 arrives first and waits; meanwhile rank 0 arrives and completes the barrier.
    store.events.append(
        lambda: (
            restart_meeting.restart_barrier(
                store, 0, initial_rank=0, participants=[0, 1, 2], decide=decide, timeout=5.0
            )
            and None
        )
    )
    got = restart_meeting.restart_barrier(
        store, 0, initial_rank=1, participants=[0, 1, 2], decide=decide, timeout=5.0
    )
    assert got == "decision"
    assert calls.count(1) == 1  # decided once, from the one fault record


def test_a_death_during_the_restart_wait_completes_it_at_once(
    store: FakeStore, clock: FakeClock
) -> None:
    # Ranks 0 and 1 wait for rank 2, which dies: its watchdog's report counts it at the
    # barrier; the report cannot decide, so the first waiter to see the count complete claims
    # the decision at once, not at its next re-check (the usual order after a SIGKILL).
    restart_meeting.set_participants(store, 0, 3)
    restart_meeting.count_once(store, 0, 1, expected=3, by="1")  # rank 1 arrived and waits
    store.events.append(
        lambda: fault_records.report_fault(
            store, iteration=0, initial_rank=2, kind="dead", detail="x"
        )
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
    assert clock.now == 1000.0  # no re-check was waited for


def test_a_rank_reported_twice_is_counted_once(store: FakeStore, clock: FakeClock) -> None:
    restart_meeting.set_participants(store, 0, 3)
    fault_records.report_fault(store, iteration=0, initial_rank=2, kind="dead", detail="watchdog")
    fault_records.report_fault(store, iteration=0, initial_rank=2, kind="dead", detail="again")
    restart_meeting.count_once(store, 0, 1)
    assert not store.check([keys.iteration_prefix(0) + "restart/full"])  # rank 0 still missing


def test_wait_outcome_returns_none_after_its_timeout(store: FakeStore, clock: FakeClock) -> None:
    assert iteration_end.wait_outcome(store, 0, timeout=10.0, clock=clock.clock()) is None
    assert clock.now >= 1010.0


def test_the_monitor_clients_are_reused_across_iterations() -> None:
    """A client whose wait ended is handed back and taken by the next iteration's monitor;
    one still in use is never given to anyone else."""
    from restartable.inprocess.restart.services import ClientPool

    opened: list[object] = []

    class Client:
        closed = False

        def close(self) -> None:
            self.closed = True

    def open_client() -> Client:
        opened.append(Client())
        return opened[-1]  # type: ignore[return-value]

    pool = ClientPool(open_client)
    first, second = pool.take(), pool.take()
    assert first is not second and len(opened) == 2
    pool.give(first)
    assert pool.take() is first and len(opened) == 2
    pool.give(second)
    pool.close()
    assert second.closed and not first.closed  # only idle clients are closed
