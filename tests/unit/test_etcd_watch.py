"""The etcd store's waits: one watch per wait while it is healthy, kept for the key's next wait,
re-armed on another member when its member hangs (``inprocess.etcd.watch``)."""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from restartable.inprocess.errors import StoreTimeoutError
from restartable.inprocess.etcd import EtcdStore
from restartable.inprocess.etcd import watch as w
from restartable.inprocess.etcd import watch_stream as ws
from tests.etcd_cluster import EtcdCluster, skip_reason

pytestmark = pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason()))


@pytest.fixture(scope="module")
def cluster() -> Iterator[EtcdCluster]:
    with EtcdCluster(members=1) as c:
        yield c


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """The keys of every watch stream opened, in order."""
    keys: list[bytes] = []

    class Counted(ws.WatchStream):
        def __init__(self, endpoints: object, key: bytes) -> None:
            keys.append(key)
            super().__init__(endpoints, key)  # type: ignore[arg-type]

    monkeypatch.setattr(w, "WatchStream", Counted)
    return keys


def _store(cluster: EtcdCluster, name: str, timeout: float) -> EtcdStore:
    return EtcdStore(cluster.url, prefix=f"watch-{name}-{os.getpid()}", timeout=timeout)


def _watch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("etcd-watch-")]


def test_a_long_wait_holds_one_watch_not_one_per_second(
    cluster: EtcdCluster, opened: list[bytes]
) -> None:
    s = _store(cluster, "long", timeout=5.0)
    threading.Timer(2.3, lambda: s.set("late", "v")).start()
    t0 = time.monotonic()
    assert s.get("late") == b"v"
    assert 2.2 < time.monotonic() - t0 < 3.5
    assert len(opened) == 1, opened  # re-armed every second until 2 December: 3 watches
    s.close()


def test_a_wait_that_timed_out_leaves_its_watch_to_the_next_wait_of_the_key(
    cluster: EtcdCluster, opened: list[bytes]
) -> None:
    s = _store(cluster, "kept", timeout=0.3)
    for _ in range(3):  # a relay's short slices: no new watch per slice
        with pytest.raises(StoreTimeoutError, match="'end'"):
            s.get("end")
    threading.Timer(0.1, lambda: s.set("end", "fault")).start()
    s.set_timeout(datetime.timedelta(seconds=3))
    assert s.get("end") == b"fault"
    assert len(opened) == 1, opened
    s.close()
    deadline = time.monotonic() + 2.0
    while _watch_threads() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _watch_threads(), "close() ends every watch"


def test_a_kept_watch_that_saw_a_put_gives_way_to_a_read_of_the_current_value(
    cluster: EtcdCluster, opened: list[bytes]
) -> None:
    s = _store(cluster, "stale", timeout=0.3)
    with pytest.raises(StoreTimeoutError):
        s.get("k")
    s.set("k", "first")
    s.set("k", "second")
    time.sleep(0.2)  # the kept watch has seen the first put by now
    assert s.get("k") == b"second"
    s.delete_all()
    s.close()


def test_a_waiter_whose_member_hangs_moves_to_another_after_the_idle_bound(
    monkeypatch: pytest.MonkeyPatch, opened: list[bytes]
) -> None:
    # A SIGSTOPped member keeps its connections open and silent: no end, no cancel reaches
    # the waiter; only the stream's idle bound (here 1.5 s instead of 5) re-arms it elsewhere.
    monkeypatch.setattr(ws, "WATCH_IDLE_S", 1.5)
    with EtcdCluster(members=3) as c:
        waiter = EtcdStore(c.url, prefix="hang", timeout=15.0, request_timeout=1.0)
        # The writer waits in short slices (0.3 s, as a relay does) but its calls are bounded
        # apart (connect_timeout): its put fails over after a 1 s request to the hung member.
        writer = EtcdStore(
            c.url, prefix="hang", timeout=0.3, connect_timeout=15.0, request_timeout=1.0
        )
        got: list[bytes] = []
        t = threading.Thread(target=lambda: got.append(waiter.get("after")), daemon=True)
        t.start()
        time.sleep(0.5)  # the waiter's watch is on the first member
        first = c.procs[c.names[0]]
        os.killpg(first.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            writer.set("after", "x")  # fails over past the stopped member
            t.join(10)
            took = time.monotonic() - t0
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(first.pid, signal.SIGCONT)
        assert got == [b"x"], "the waiter re-armed its watch on a member that answers"
        assert took < 6.0, took
        assert len(opened) >= 2, opened
        t1 = time.monotonic()
        with pytest.raises(StoreTimeoutError):
            writer.get("never")  # its blocking get keeps its own short bound
        assert time.monotonic() - t1 < 3.0
        waiter.close()
        writer.close()


def test_a_watch_on_a_member_that_lost_its_leader_ends_before_the_idle_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The hasleader metadata: etcd cancels the watch once its member has had no leader for a
    # few election timeouts (3.9 s measured here), instead of keeping a stream no put reaches.
    monkeypatch.setattr(ws, "WATCH_IDLE_S", 30.0)
    with EtcdCluster(members=3) as c:
        s = EtcdStore(c.url, prefix="leaderless", timeout=30.0, request_timeout=1.0)
        stream = ws.WatchStream(s._endpoints, s._keys.k("x"))
        assert stream.ready.wait(5) and stream.created
        t0 = time.monotonic()
        c.kill(c.names[1])
        c.kill(c.names[2])
        assert stream.done.wait(20), "the watch outlived its member's leader"
        assert stream.value is None and time.monotonic() - t0 < 20
        stream.close()
        s.close()
