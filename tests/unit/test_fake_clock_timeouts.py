"""A soft timeout, a hard timeout and a heartbeat loss driven to their decisions on the fake
clock, without sleeping: the real decision code (the rank's monitor, the watchdog process's
``Watch``) fed by a ``FakeClock`` that the test moves, asserting what a user sees: which
timeout, which rank, the fault record in the store and what was fired. (The barrier timeout's
test is the fault path's.)"""

from __future__ import annotations

import signal

import pytest

from restartable.inprocess.protocol import fault_records, iteration_end, keys
from restartable.inprocess.restart.interrupter import Interrupter
from restartable.inprocess.restart.monitor import Monitor, MonitorLimits
from restartable.inprocess.restart.progress import ProgressTracker
from restartable.inprocess.watchdog.watch import Verdict, Watch, report_to
from tests.fake_clock import FakeClock
from tests.unit.test_inprocess_store import FakeStore

HARD_TIMEOUT = 10.0
GRACE = 5.0
INTERVAL = 1.0  # the rank's heartbeat_interval
RANK, ITERATION = 2, 3
# Above Linux's largest pid: the hard-timeout notice this names can be no real process's.
NO_SUCH_PID = 4_194_304 + 7


class FakeRankProcess:
    """The watched rank process: records the signals it gets and ends on ``dies_on`` (None:
    never, as a process stuck in the kernel); waiting for its end moves the fake clock."""

    def __init__(self, fake: FakeClock, *, dies_on: int | None) -> None:
        self.pid = NO_SUCH_PID
        self.signals: list[int] = []
        self.alive = True
        self._fake = fake
        self._dies_on = dies_on

    def signal(self, sig: int) -> None:
        self.signals.append(sig)
        if sig == self._dies_on:
            self.alive = False

    def wait_gone(self, timeout: float) -> bool:
        if self.alive:
            self._fake.advance(timeout)  # the whole wait passes: nothing ends it early
        return not self.alive


@pytest.fixture
def fake() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(fake: FakeClock) -> FakeStore:
    return FakeStore(fake)


def watch_of(fake: FakeClock, store: FakeStore, rank: FakeRankProcess) -> Watch:
    """Rank ``RANK``'s watch in ``ITERATION``, reporting to ``store`` as the process does."""
    clock = fake.clock()
    return Watch(
        initial_rank=RANK,
        iteration=ITERATION,
        reserve=False,
        hard_timeout=HARD_TIMEOUT,
        grace=GRACE,
        rank=rank,
        report=lambda verdict: report_to(store, verdict, clock=clock),
        clock=clock,
    )


def beat(watch: Watch, iteration: int = ITERATION) -> Verdict | str | None:
    return watch.step(f"{iteration}\n".encode(), eof=False, gone=False)


def nothing(watch: Watch) -> Verdict | str | None:
    """The loop's wait ended with no input: the hard timeout is judged."""
    return watch.step(b"", eof=False, gone=False)


def test_a_heartbeat_loss_is_judged_from_the_last_beat_and_ends_the_rank(
    fake: FakeClock, store: FakeStore
) -> None:
    rank = FakeRankProcess(fake, dies_on=signal.SIGTERM)
    watch = watch_of(fake, store, rank)
    for _ in range(3 * int(HARD_TIMEOUT)):  # beats for three hard timeouts: never a decision
        fake.advance(INTERVAL)
        assert beat(watch) is None
    last_beat = fake.now
    fake.advance(HARD_TIMEOUT - 0.5)
    assert watch.wait_s() == pytest.approx(0.5)  # how long the process's loop may wait now
    assert nothing(watch) is None and rank.signals == []
    fake.advance(0.5)
    verdict = nothing(watch)
    assert verdict == Verdict(
        kind="hard_timeout",
        detail=f"no heartbeat for {HARD_TIMEOUT} s (GIL held or process frozen); ended by SIGTERM",
        initial_rank=RANK,
        iteration=ITERATION,
        reserve=False,
    )
    assert rank.signals == [signal.SIGCONT, signal.SIGTERM]  # no SIGKILL: it ended in time
    (record,) = fault_records.read_faults(store, ITERATION)
    assert (record.kind, record.initial_rank, record.time) == ("hard_timeout", RANK, fake.now)
    assert fake.now == last_beat + HARD_TIMEOUT
    assert iteration_end.outcome(store, ITERATION) == keys.OUTCOME_FAULT  # every rank restarts
    assert keys.gone_ranks(store) == {RANK}  # no barrier waits for it any more


def test_a_hard_timeout_kills_a_rank_that_ignores_sigterm_after_the_grace(
    fake: FakeClock, store: FakeStore
) -> None:
    rank = FakeRankProcess(fake, dies_on=signal.SIGKILL)  # frozen with the GIL held
    watch = watch_of(fake, store, rank)
    assert beat(watch, 4) is None  # the rank entered iteration 4
    start = fake.now
    fake.advance(HARD_TIMEOUT)
    verdict = nothing(watch)
    assert isinstance(verdict, Verdict) and verdict.iteration == 4
    assert verdict.detail.endswith(f"ended by SIGKILL after {GRACE} s grace")
    assert rank.signals == [signal.SIGCONT, signal.SIGTERM, signal.SIGKILL]
    assert fake.now == start + HARD_TIMEOUT + GRACE  # the grace was waited on the clock
    (record,) = fault_records.read_faults(store, 4)
    assert (record.kind, record.initial_rank) == ("hard_timeout", RANK)
    assert fault_records.read_faults(store, ITERATION) == []


def test_a_lost_heartbeat_pipe_is_a_death_reported_at_once(
    fake: FakeClock, store: FakeStore
) -> None:
    rank = FakeRankProcess(fake, dies_on=None)
    watch = watch_of(fake, store, rank)
    start = fake.now
    verdict = watch.step(b"", eof=True, gone=False)  # the rank's end of the pipe closed
    assert isinstance(verdict, Verdict) and verdict.kind == "dead"
    assert verdict.detail == f"rank process {NO_SUCH_PID} disappeared"
    assert fake.now == start and rank.signals == []  # no timeout waited, nothing signalled
    (record,) = fault_records.read_faults(store, ITERATION)
    assert (record.kind, record.initial_rank) == ("dead", RANK)


def test_a_close_written_before_the_death_wins(fake: FakeClock, store: FakeStore) -> None:
    watch = watch_of(fake, store, FakeRankProcess(fake, dies_on=None))
    assert watch.step(b"3\nclose\n", eof=True, gone=True) == "close"
    assert fault_records.read_faults(store, ITERATION) == []


def test_a_soft_timeout_is_recorded_for_the_stalled_rank_and_fires_the_restart(
    fake: FakeClock, store: FakeStore
) -> None:
    aborted: list[float] = []
    progress = ProgressTracker(clock=fake.clock())
    interrupter = Interrupter()  # never armed: the restart is not raised into this test
    monitor = Monitor(
        store=store,
        report_store=store,
        iteration=ITERATION,
        initial_rank=1,
        # check_interval: the monitor's real Event wait between two checks
        limits=MonitorLimits(soft_timeout=60.0, check_interval=0.001, redeliver_interval=1.0),
        progress=progress,
        interrupter=interrupter,
        abort=lambda: aborted.append(fake.now),
        step=lambda: 17,
        clock=fake.clock(),
    )
    try:
        fake.advance(60.5)  # the main thread ran no bytecode the monitor saw for 60.5 s
        monitor._watch_progress()  # the progress thread's body: returns once it recorded
        (record,) = fault_records.read_faults(store, ITERATION)
        assert (record.kind, record.initial_rank, record.step) == ("soft_timeout", 1, 17)
        assert record.detail == "no progress for 60.5 s (soft_timeout 60.0)"
        assert record.time == fake.now
        assert iteration_end.outcome(store, ITERATION) == keys.OUTCOME_FAULT
        monitor._watch_store()  # the store thread's body: sees the fault and fires
        assert aborted == [fake.now] and monitor.fired_at == fake.now
    finally:
        monitor.close()
        progress.close()
        interrupter.close()
