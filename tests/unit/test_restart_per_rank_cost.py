"""What one restart costs each rank on the store, against docs/scale.md's first measured figures
(before the per-rank path regressed, issue 52): 9.0 calls and ~718 payload bytes per rank at
4,096 ranks, and a death's record that is done before the ranks it wakes call the store.

Counted as ``benchmarks/restart_scale.py`` counts: every c10d call (the generic fast paths of a
TCPStore count call by call), keys and values sent plus values received, an integer as 8 bytes.
"""

from __future__ import annotations

import datetime
import functools
import statistics
import threading
from collections.abc import Sequence

import pytest
import torch.distributed as dist

from restartable.inprocess.config import RestartConfig
from restartable.inprocess.errors import FaultRecord
from restartable.inprocess.protocol import (
    barriers,
    fault_records,
    iteration_end,
    job_keys,
    keys,
    restart_meeting,
)
from restartable.inprocess.protocol.policy import Assignment, Decision, Observed, decide
from restartable.inprocess.protocol.ranks import initial_assignment, node_of_ranks
from restartable.inprocess.protocol.store import C10dStore, StoreBase

# docs/scale.md's first table (commit 8959b4f), 4,096 simulated ranks on a TCPStore.
OLD_CALLS_PER_RANK = 9.0
OLD_BYTES_PER_RANK = 718
FAULT_RANK = 1


def _size(value: object) -> int:
    return len(value) if isinstance(value, (bytes, str)) else 8


class Counting(StoreBase):
    """One rank's client: counts its c10d calls and payload bytes."""

    def __init__(self, raw: dist.Store) -> None:
        self.inner, self.calls, self.bytes, self.log = C10dStore(raw), 0, 0, list[str]()

    def _n(self, op: str, out: int, result: object = None) -> None:
        self.calls += 1
        self.log.append(op)
        self.bytes += out + (0 if result is None else _size(result))

    def set(self, key: str, value: str | bytes) -> None:
        self.inner.set(key, value)
        self._n("set", len(key) + _size(value))

    def get(self, key: str) -> bytes:
        got = self.inner.get(key)
        self._n("get", len(key), got)
        return got

    def add(self, key: str, value: int) -> int:
        got = self.inner.add(key, value)
        self._n("add", len(key) + 8, got)
        return got

    def append(self, key: str, value: str | bytes) -> None:
        self.inner.append(key, value)
        self._n("append", len(key) + _size(value))

    def compare_set(
        self, key: str, expected_value: str | bytes, desired_value: str | bytes
    ) -> bytes:
        got = self.inner.compare_set(key, expected_value, desired_value)
        self._n("compare_set", len(key) + _size(expected_value) + _size(desired_value), got)
        return got

    def check(self, keys: Sequence[str]) -> bool:
        got = self.inner.check(keys)
        self._n("check", sum(map(len, keys)), got)
        return got

    def wait(self, keys: Sequence[str], timeout: datetime.timedelta) -> None:
        self._n("wait", sum(map(len, keys)))  # before: a wait that times out was a call too
        self.inner.wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        got = self.inner.delete_key(key)
        self._n("delete_key", len(key), got)
        return got

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        got = self.inner.multi_get(keys)
        self._n("multi_get", sum(map(len, keys)) + sum(map(len, got)))
        return got

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        self.inner.multi_set(keys, values)
        self._n("multi_set", sum(map(len, keys)) + sum(map(_size, values)))

    def torch_store(self) -> dist.Store:
        return self.inner.torch_store()


def _decide(store: Counting, a: Assignment, n: int, faults: list[FaultRecord]) -> str:
    """What ``restart_meeting.decide`` reads and does (``benchmarks/restart_scale._decide``)."""
    gone, joined = job_keys.gone_and_ready_joiners(store)
    node_of = node_of_ranks(world_size=n, local_world_size=8)
    observed = Observed(iteration=0, faults=tuple(faults), gone=frozenset(gone), joined=joined)
    return decide(
        observed,
        history=[],
        assignment=a,
        target=len(a.active),
        node_of=node_of,
        config=RestartConfig(),
    ).to_json()


def _restart(n: int) -> dict[int, Counting]:
    """``benchmarks/restart_scale.py``'s restart phase with ``n`` ranks (threads, one client
    each, on a real in-memory torch store): rank 1 dies, its watchdog records it, every other
    rank meets at the restart barrier and the new active ranks pass the next join barrier.
    Returns each rank's counts for the restart alone."""
    raw = dist.HashStore()
    raw.set_timeout(datetime.timedelta(seconds=60))
    node_of = node_of_ranks(world_size=n, local_world_size=8)
    a = initial_assignment(
        world_size=n, node_of=node_of, active_world_size=n - max(1, n // 64), granularity="rank"
    )
    job_keys.start_iteration(
        C10dStore(raw), 0, participants=len(a.active) + len(a.reserve), reserves=a.reserve
    )
    clients = {r: Counting(raw) for r in range(n)}
    fault_records.report_fault(  # the killed rank's watchdog (rank 1's client)
        clients[FAULT_RANK], iteration=0, initial_rank=FAULT_RANK, kind="dead", detail="SIGKILL"
    )

    def rank(me: int) -> None:
        store = clients[me]
        assert iteration_end.wait_outcome(store, 0, timeout=60.0) == keys.OUTCOME_FAULT
        raw_decision = restart_meeting.restart_barrier(
            store,
            0,
            initial_rank=me,
            participants=a.active + a.reserve,
            decide=functools.partial(_decide, store, a, n),
            timeout=60.0,
        )
        new = Decision.from_json(raw_decision).assignment
        assert new is not None and FAULT_RANK in new.retired
        if new.rank_of(me) is not None:
            assert barriers.join_barrier(store, 1, expected=len(new.active), timeout=60.0)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n) if r != FAULT_RANK]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    return clients


def test_a_restart_costs_each_rank_what_it_did_before_the_regression(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Counted: the path of a restart that takes less than a waiter's re-check interval. On this
    # shared machine a decision may come later than 1 s, and the re-checks' calls (tested in
    # test_restart_protocol_scale.py) would be counted too.
    monkeypatch.setattr(barriers, "RECHECK_S", 60.0)
    for n in (64, 256):
        clients = _restart(n)
        calls = [c.calls for c in clients.values()]
        # A rank that waits and joins: the outcome (wait, get), its count (add, add), the
        # decision (wait, get), the join barrier (add, wait, get): 9, as before.
        assert statistics.median(calls) == OLD_CALLS_PER_RANK
        # The rest is a constant per restart, not per rank: the decider's reads, the death
        # record, the last arrivals that watch the count's completion.
        assert sum(calls) <= OLD_CALLS_PER_RANK * n + 2 * restart_meeting.FULL_WATCHERS + 24
        # Bytes: the decision every rank reads carries its fault records without their default
        # fields, so a rank now moves fewer bytes than then (~590 at 256 ranks).
        assert sum(c.bytes for c in clients.values()) / n <= OLD_BYTES_PER_RANK - 100


def test_a_death_is_counted_before_the_iteration_ends() -> None:
    # The ranks the end wakes all call the store at once: a count behind them waited seconds.
    clients = _restart(16)
    log = clients[FAULT_RANK].log
    # The participants' count is read first: a node path's mark there skips the count.
    assert log[: log.index("compare_set")] == ["append", "append", "check", "get", "add", "add"]
    assert log[-3:] == ["compare_set"] * 3  # end, join/go, ready/go: last


def test_a_death_reported_after_every_live_rank_arrived_is_decided_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The dead rank's peers saw a broken collective and arrived first: its report completes the
    # count, no live rank did. The last arrivals watch for that and claim the decision; the
    # others wait for the decision alone. A re-check (made 30 s here) would show as a stall.
    monkeypatch.setattr(barriers, "RECHECK_S", 30.0)
    n = 48
    raw = dist.HashStore()
    raw.set_timeout(datetime.timedelta(seconds=60))
    restart_meeting.set_participants(C10dStore(raw), 0, n)
    clients = {r: Counting(raw) for r in range(n)}
    out: dict[int, str] = {}

    def rank(me: int) -> None:
        out[me] = restart_meeting.restart_barrier(
            clients[me],
            0,
            initial_rank=me,
            participants=range(n),
            decide=lambda faults: ",".join(str(f.initial_rank) for f in faults),
            timeout=60.0,
        )

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n) if r != FAULT_RANK]
    for t in threads:
        t.start()
    counter = keys.key(0, "restart/n")
    while int(raw.add(counter, 0)) < n - 1:  # every live rank counted
        threading.Event().wait(0.01)
    fault_records.report_fault(
        C10dStore(raw), iteration=0, initial_rank=FAULT_RANK, kind="dead", detail="SIGKILL"
    )
    for t in threads:
        t.join(10)  # well before a re-check
    assert not any(t.is_alive() for t in threads)
    assert set(out.values()) == {str(FAULT_RANK)}
    watchers = [r for r, c in clients.items() if "compare_set" in c.log]
    assert 1 <= len(watchers) <= restart_meeting.FULL_WATCHERS  # they claimed; one decided
