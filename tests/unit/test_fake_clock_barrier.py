"""A barrier timeout driven to its decision on the fake clock, over a real store, without sleeping.

The store is a real TCPStore server on 127.0.0.1 (the protocol's calls go over its wire); only
time is fake. The barrier's clock is a ``FakeClock`` that the other ranks' absence moves: every
reading finds ``BARRIER_TIMEOUT`` more seconds gone, so the first wait's deadline has already
passed and the barrier ends with the error a user sees, before any blocking ``wait`` is made.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from restartable.inprocess.clock import Clock
from restartable.inprocess.errors import FaultRecord, StoreTimeoutError
from restartable.inprocess.protocol import (
    barriers,
    fault_records,
    iteration_end,
    keys,
    restart_meeting,
)
from restartable.inprocess.protocol.store import Store, as_store
from tests.fake_clock import FakeClock

BARRIER_TIMEOUT = 300.0  # RestartConfig's barrier_timeout, as a user leaves it


@pytest.fixture
def store() -> Iterator[Store]:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore(
        "127.0.0.1",
        server.port,
        is_master=False,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=5),
    )
    yield as_store(client)


def _absent_peers(fake: FakeClock) -> Clock:
    """A clock on ``fake`` whose every reading comes ``BARRIER_TIMEOUT`` after the previous one:
    the peers never arrive in time."""

    def monotonic() -> float:
        fake.advance(BARRIER_TIMEOUT)
        return fake()

    return Clock(monotonic=monotonic, wall=fake, sleep=fake.advance)


def test_a_join_barrier_whose_peers_never_come_times_out_on_the_fake_clock(store: Store) -> None:
    fake = FakeClock()
    start = time.monotonic()
    with pytest.raises(StoreTimeoutError) as err:
        barriers.join_barrier(
            store, 0, expected=2, timeout=BARRIER_TIMEOUT, clock=_absent_peers(fake)
        )
    # What the wrapper raises to the user's script, and records as the job's stop reason.
    assert str(err.value) == "barrier 'restartable/it0/join' did not complete within its timeout"
    assert fake() == 1000.0 + 2 * BARRIER_TIMEOUT  # the deadline, then the first wait's check
    assert time.monotonic() - start < 2.0  # no real wait for the barrier's timeout
    # This rank arrived on the real store; the barrier was never released, by "ok" or a fault.
    assert keys.peek(store, keys.key(0, "join/go")) is None
    assert iteration_end.outcome(store, 0) is None


def test_a_restart_barrier_missing_a_live_rank_times_out_without_deciding(store: Store) -> None:
    fake = FakeClock()
    restart_meeting.set_participants(store, 0, 2)
    fault_records.report_fault(
        store, iteration=0, initial_rank=0, kind="exception", detail="ValueError: x"
    )
    decided: list[list[FaultRecord]] = []

    def decide(faults: list[FaultRecord]) -> str:
        decided.append(faults)
        return "decision"

    with pytest.raises(StoreTimeoutError, match=r"^restart barrier 0 did not complete within"):
        restart_meeting.restart_barrier(
            store,
            0,
            initial_rank=0,
            participants=[0, 1],
            decide=decide,
            timeout=BARRIER_TIMEOUT,
            clock=_absent_peers(fake),
        )
    assert decided == []  # rank 1 is alive (not reported gone): nobody decides without it
    assert keys.peek(store, keys.key(0, "restart/go")) is None


def test_the_same_barrier_released_in_time_is_not_a_timeout(store: Store) -> None:
    # The control: with the peer's arrival on the store first, the fake clock is never read
    # past the deadline and the barrier releases with "ok".
    fake = FakeClock()
    store.count_arrival(keys.key(0, "join") + "/n")  # rank 1 arrived
    assert barriers.join_barrier(
        store, 0, expected=2, timeout=BARRIER_TIMEOUT, clock=_absent_peers(fake)
    )
