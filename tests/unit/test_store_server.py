"""The detached store server's housekeeping loop (``inprocess.store_server.serve``) on the fake
clock: it ends once every rank left, or after its idle timeout, without a real second passing."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import pytest

from restartable.checkpoint.sealing import SECRET_ENV, Sealer
from restartable.inprocess import store_server
from restartable.inprocess.clock import Clock
from restartable.inprocess.protocol.sealed_store import seal
from tests.fake_clock import FakeClock
from tests.multiproc import free_port

pytestmark = pytest.mark.timeout(60)
SECRET = "ab" * 32


@pytest.fixture(autouse=True)
def _sigterm_restored() -> Iterator[None]:
    before = signal.getsignal(signal.SIGTERM)  # serve() ignores SIGTERM, as a detached server
    yield
    signal.signal(signal.SIGTERM, before)


@pytest.fixture(autouse=True)
def _job_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_ENV, SECRET)


def test_an_idle_server_ends_after_its_idle_timeout_on_the_fake_clock() -> None:
    fake = FakeClock()
    start, t0 = fake.now, time.monotonic()
    store_server.serve(
        port=0, world_size=2, idle_timeout=30.0, host="127.0.0.1", clock=fake.clock()
    )
    # One look per _POLL_S of fake time: nothing changed for 30 s, so it ended at the first
    # look past them (the first look records the key count).
    assert 30.0 < fake.now - start <= 30.0 + 2 * store_server._POLL_S
    assert time.monotonic() - t0 < 20.0  # the fake clock slept, not this process


def test_the_server_ends_once_every_rank_left() -> None:
    fake, port = FakeClock(), free_port()

    def sleep(seconds: float) -> None:  # the ranks leave while the server sleeps its first poll
        fake.advance(seconds)
        if fake.now - start == store_server._POLL_S:
            import torch.distributed as dist

            raw = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
            ranks = seal(raw, Sealer(bytes.fromhex(SECRET)))
            assert [store_server.mark_left(ranks, r) for r in (0, 1, 1)] == [1, 2, 2]

    start = fake.now
    clock = Clock(monotonic=fake, wall=fake, sleep=sleep)
    store_server.serve(port=port, world_size=2, idle_timeout=3600.0, host="127.0.0.1", clock=clock)
    assert fake.now - start == store_server._POLL_S  # the first look found both ranks gone
