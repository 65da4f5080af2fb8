"""The pure-Python TCPStore client (inprocess.protocol.tcpstore_client) against torch's real
TCPStore server, side by side with torch's own client: fails loudly when torch changes its
private wire protocol (issue 35: the watchdog uses it to stay free of torch)."""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Iterator

import pytest
from torch.distributed import TCPStore

from restartable.inprocess.protocol import fault_records, keys
from restartable.inprocess.protocol.tcpstore_client import TCPStoreClient

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def server() -> Iterator[TCPStore]:
    s = TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=20),
    )
    yield s
    del s


@pytest.fixture
def ours(server: TCPStore) -> Iterator[TCPStoreClient]:
    c = TCPStoreClient("127.0.0.1", server.port, timeout=10.0)
    yield c
    c.close()


def test_every_call_agrees_with_torchs_client(server: TCPStore, ours: TCPStoreClient) -> None:
    ours.set("a", "1")
    assert server.get("a") == b"1"
    server.set("b", b"\x00bin\xff")
    assert ours.get("b") == b"\x00bin\xff"
    assert ours.add("n", 3) == 3 and server.add("n", 2) == 5 and ours.add("n", 0) == 5
    # APPEND has no reply in the protocol (torch's client does not wait either), so appends on
    # two connections may land in any order: a round trip on the same connection (check) makes
    # sure each was applied before the other connection appends.
    ours.append("l", "x,")
    assert ours.check(["l"])
    server.append("l", "y,")
    assert server.check(["l"])
    ours.append("l", b"z,")
    assert server.get("l") == b"x,y,z," == ours.get("l")
    # compare_set: an absent key with expected "" is set; a mismatch returns the current value.
    assert ours.compare_set("c", "", "first") == b"first"
    assert ours.compare_set("c", "", "second") == b"first"
    assert ours.compare_set("c", "first", "third") == b"third" == server.get("c")
    assert ours.check(["a", "b"]) and not ours.check(["a", "missing"])
    ours.multi_set(["m1", "m2"], ["v1", b"v2"])
    assert server.multi_get(["m1", "m2"]) == [b"v1", b"v2"]


def test_wait_returns_when_another_client_sets_the_key(
    server: TCPStore, ours: TCPStoreClient
) -> None:
    threading.Timer(0.2, lambda: server.set("late", "here")).start()
    t0 = time.monotonic()
    ours.wait(["late"], datetime.timedelta(seconds=10))
    assert 0.1 < time.monotonic() - t0 < 5
    assert ours.get("late") == b"here"


def test_a_timed_out_wait_leaves_the_connection_usable(
    server: TCPStore, ours: TCPStoreClient
) -> None:
    with pytest.raises(TimeoutError, match="timeout"):
        ours.wait(["never"], datetime.timedelta(seconds=0.2))
    ours.set("after", "ok")  # the cancel's answer was read: requests and answers stay in step
    assert ours.get("after") == b"ok" and ours.add("k", 1) == 1


def test_the_protocols_fault_report_reads_back_through_torch(
    server: TCPStore, ours: TCPStoreClient
) -> None:
    from restartable.inprocess.protocol.store import as_store

    # Both ends as the framework opens them: behind the Store protocol (as_store, as seal does).
    mine, theirs = as_store(ours), as_store(server)
    fault_records.report_fault(mine, iteration=2, initial_rank=1, kind="dead", detail="gone")
    assert server.get(keys.end_key(2)) == keys.OUTCOME_FAULT.encode()
    (f,) = fault_records.read_faults(theirs, 2)
    assert (f.initial_rank, f.kind) == (1, "dead") and keys.gone_ranks(theirs) == {1}
    fault_records.record_reserve_gone(mine, 3, 4)
    assert keys.gone_ranks(theirs) == {1, 4} and not server.check([keys.end_key(3)])


def test_multi_get_and_delete_key_match_torchs_client(
    server: TCPStore, ours: TCPStoreClient
) -> None:
    server.set("a", b"1")
    server.set("b", b"")
    assert ours.multi_get(["a", "b"]) == server.multi_get(["a", "b"]) == [b"1", b""]
    assert ours.delete_key("a") is True and ours.delete_key("a") is False
    assert not server.check(["a"])


def test_connecting_to_a_closed_port_fails_within_the_timeout() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
        t0 = time.monotonic()
        with pytest.raises(OSError):
            TCPStoreClient("127.0.0.1", port, timeout=0.3)
        assert time.monotonic() - t0 < 3


def test_a_server_that_never_answers_fails_the_connection_naming_it_and_the_bound() -> None:
    # A listening socket nobody serves: the kernel completes the handshake, the PING is never
    # answered. The connect bound is its own (a relay's 1 s call slice must not bound it).
    import socket

    with socket.create_server(("127.0.0.1", 0)) as mute:
        port = mute.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(TimeoutError) as err:
            TCPStoreClient("127.0.0.1", port, timeout=0.05, connect_timeout=0.5)
        assert 0.4 < time.monotonic() - t0 < 3.0
    assert f"127.0.0.1:{port}" in str(err.value) and "(0.5 s)" in str(err.value)
