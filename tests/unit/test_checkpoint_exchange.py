"""StoreExchange: the background save protocol's meeting point (a real in-memory torch store)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch.distributed as dist

from restartable.checkpoint.errors import CheckpointAbandoned, CheckpointError
from restartable.checkpoint.exchange import Attempts, StoreExchange


def _exchange(store: Any, rank: int, *, world: int = 3, timeout: float = 10.0) -> StoreExchange:
    return StoreExchange(
        store, "ns", rank=rank, world=world, cancel=threading.Event(), timeout=timeout
    )


def _round(ex: StoreExchange) -> tuple[Any, Any]:
    gathered = ex.gather("plan", f"plan of {ex.rank}")
    if gathered is not None:
        for r in range(ex.world):
            ex.publish("part", f"part for {r}", to=r)
        ex.publish("commit", sorted(gathered))
    return ex.receive("part", mine=True), ex.receive("commit")


def test_gather_publish_receive_between_ranks_and_keys_are_cleaned_up() -> None:
    store = dist.HashStore()
    exchanges = [_exchange(store, r) for r in range(3)]
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(_round, reversed(exchanges)))[::-1]
    plans = ["plan of 0", "plan of 1", "plan of 2"]
    assert results == [(f"part for {r}", plans) for r in range(3)]
    exchanges[0].discard("commit")
    # Gathered and per-rank keys are deleted by their reader: nothing left behind.
    assert store.num_keys() == 0


class _Recording:
    """A store that records the order of writes and deletes (delegates to a HashStore)."""

    def __init__(self) -> None:
        self._store = dist.HashStore()
        self.log: list[tuple[str, str]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def set(self, key: str, value: bytes) -> None:
        self.log.append(("set", key))
        self._store.set(key, value)

    def delete_key(self, key: str) -> bool:
        self.log.append(("delete", key))
        return bool(self._store.delete_key(key))


def test_the_answer_is_published_before_the_gathered_keys_are_deleted() -> None:
    # At 1,024 ranks, deleting every gathered key (one call each) before publishing the answer
    # was most of a step agreement's time: every peer waited for the deletes.
    store = _Recording()
    exchanges = [_exchange(store, r) for r in range(3)]
    with ThreadPoolExecutor(3) as pool:
        list(pool.map(_round, reversed(exchanges)))
    order = [key for op, key in store.log]
    first_delete = min(i for i, (op, key) in enumerate(store.log) if op == "delete")
    assert order.index("ns/commit") < first_delete, store.log
    assert {"ns/plan/0", "ns/plan/1", "ns/plan/2", "ns/plan/n"} <= {
        key for op, key in store.log if op == "delete"
    }


def test_cancel_ends_a_wait_on_a_rank_that_never_comes() -> None:
    ex = _exchange(dist.HashStore(), 0, timeout=60.0)
    threading.Timer(0.2, ex.cancel.set).start()
    t0 = time.monotonic()
    with pytest.raises(CheckpointAbandoned, match="plan"):
        ex.gather("plan", "mine")  # ranks 1 and 2 never post
    assert time.monotonic() - t0 < 5.0


def test_timeout_names_the_missing_ranks() -> None:
    store = dist.HashStore()
    _exchange(store, 1, timeout=0.3).gather("write", "done")
    with pytest.raises(CheckpointError, match=r"rank\(s\) \[2\] did not reach 'write'"):
        _exchange(store, 0, timeout=0.3).gather("write", "done")


def test_single_process_needs_no_store() -> None:
    ex = StoreExchange(None, "", rank=0, world=1, cancel=threading.Event(), timeout=1.0)
    assert ex.gather("plan", 5) == [5]
    ex.publish("commit", "ok")
    assert ex.receive("commit") == "ok"


def test_attempts_count_saves_per_group_token() -> None:
    attempts = Attempts("local", timeout=1.0)
    solo, previous = attempts.next(None, None)
    assert solo.world == 1 and previous is None
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        first, previous = attempts.next(group, "tokA")
        second, previous2 = attempts.next(group, "tokA")
        after_restart, previous3 = attempts.next(group, "tokB")
    finally:
        dist.destroy_process_group()
    assert first.namespace.endswith("/local/tokA/1") and previous is None
    assert second.namespace.endswith("/local/tokA/2") and previous2 is first
    # A new group (after a restart) starts a new count; the old attempt's keys are not its own.
    assert after_restart.namespace.endswith("/local/tokB/1") and previous3 is None
