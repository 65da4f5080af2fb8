"""Issue 35: a restart decision short of ranks waits for the respawns the launchers announced
(``inprocess.protocol.capacity``), with a fake store and a fake clock."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from restartable.inprocess.clock import Clock
from restartable.inprocess.config import RestartConfig
from restartable.inprocess.errors import ConfigError, FaultRecord
from restartable.inprocess.protocol import capacity, job_keys
from restartable.inprocess.protocol.policy import DecisionInputs
from restartable.inprocess.protocol.ranks import Assignment
from tests.fake_clock import FakeClock
from tests.unit.test_inprocess_store import FakeStore

W = 4  # 3 active + 1 reserve; respawned identities are slot + generation * W


def _deciding(assignment: Assignment, dead: int, **options: object) -> DecisionInputs:
    """The decision's inputs for iteration 1, in which initial rank ``dead``'s process died."""
    cfg = RestartConfig(active_world_size=3, min_active_world_size=3, **options)  # type: ignore[arg-type]
    fault = FaultRecord(iteration=1, initial_rank=dead, kind="dead", detail="gone", time=1.0)
    return DecisionInputs(
        1,
        (fault,),
        history=[],
        assignment=assignment,
        target=3,
        node_of=tuple(range(W)),
        config=cfg,
    )


def _clock_running(fake: FakeClock, at: float, event: Callable[[], None]) -> Clock:
    """A clock whose sleep runs ``event`` once the fake time passes ``at`` seconds."""
    start = fake.now
    fired = []

    def sleep(s: float) -> None:
        fake.advance(s)
        if not fired and fake.now - start >= at:
            fired.append(True)
            event()

    return Clock(monotonic=fake, wall=fake, sleep=sleep)


# Iteration 0 lost rank 0 (the reserve 3 took its place; slot 0's respawn, identity 4, is still
# starting); now rank 1 died too: 2 healthy ranks for 3 places.
AFTER_FIRST = Assignment(active=(3, 1, 2), reserve=(), retired=frozenset({0}))


def _store(fake: FakeClock) -> FakeStore:
    store = FakeStore(fake)
    job_keys.announce_respawn(store, 4)  # slot 0, generation 1
    job_keys.mark_gone(store, 0)
    job_keys.mark_gone(store, 1)
    job_keys.announce_respawn(store, 5)  # slot 1, generation 1
    return store


def test_a_short_decision_waits_for_the_respawn_on_its_way_and_logs_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake = FakeClock()
    store = _store(fake)
    clock = _clock_running(fake, 1.5, lambda: job_keys.register_joiner(store, 4))
    with caplog.at_level(logging.INFO, logger="restartable.inprocess.protocol.capacity"):
        d = capacity.decide_waiting(store, _deciding(AFTER_FIRST, 1), timeout=10.0, clock=clock)
    assert d.stop is None and d.assignment is not None, d
    assert d.assignment.active == (3, 4, 2)  # the respawned process took rank 1's place
    assert 1.5 <= fake.now - 1000.0 < 1.6  # waited until it registered, not the timeout
    (msg,) = [r.getMessage() for r in caplog.records]
    assert "waited 1.5" in msg and "identities [4, 5]" in msg and "joined [4]" in msg, msg


def test_without_announced_respawns_the_decision_stops_at_once() -> None:
    fake = FakeClock()
    store = FakeStore(fake)
    job_keys.mark_gone(store, 0)
    job_keys.mark_gone(store, 1)
    d = capacity.decide_waiting(store, _deciding(AFTER_FIRST, 1), timeout=10.0, clock=fake.clock())
    assert d.assignment is None and d.stop and "not enough healthy ranks" in d.stop, d
    assert fake.now == 1000.0  # no wait


def test_the_wait_is_bounded_by_the_timeout() -> None:
    fake = FakeClock()
    store = _store(fake)
    d = capacity.decide_waiting(store, _deciding(AFTER_FIRST, 1), timeout=2.0, clock=fake.clock())
    assert d.assignment is None and d.stop and "not enough healthy ranks" in d.stop, d
    assert 2.0 <= fake.now - 1000.0 < 2.1


def test_a_respawn_that_dies_before_it_registers_ends_the_wait() -> None:
    fake = FakeClock()
    store = _store(fake)
    clock = _clock_running(
        fake, 0.5, lambda: (job_keys.mark_gone(store, 4), job_keys.mark_gone(store, 5))
    )
    d = capacity.decide_waiting(store, _deciding(AFTER_FIRST, 1), timeout=10.0, clock=clock)
    assert d.assignment is None and d.stop, d
    assert fake.now - 1000.0 < 0.6


def test_a_full_decision_never_waits() -> None:
    fake = FakeClock()
    store = FakeStore(fake)
    job_keys.mark_gone(store, 1)
    job_keys.announce_respawn(store, 5)
    full = Assignment(active=(0, 1, 2), reserve=(3,), retired=frozenset())
    d = capacity.decide_waiting(store, _deciding(full, 1), timeout=10.0, clock=fake.clock())
    assert d.assignment is not None and d.assignment.active == (0, 3, 2), d
    assert fake.now == 1000.0


def test_respawn_wait_timeout_is_validated() -> None:
    with pytest.raises(ConfigError, match=r"respawn_wait_timeout \(130.0\).*barrier_timeout"):
        RestartConfig(respawn_wait_timeout=130.0)
    with pytest.raises(ConfigError, match="respawn_wait_timeout"):
        RestartConfig(respawn_wait_timeout=-1.0)
    assert RestartConfig(respawn_wait_timeout=0.0).effective_respawn_wait_timeout == 0.0
    assert RestartConfig().effective_respawn_wait_timeout == 10.0  # a loaded cold start
    assert RestartConfig(barrier_timeout=6.0).effective_respawn_wait_timeout == 3.0
