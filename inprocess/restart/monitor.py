"""The monitor thread: turns a fault of the current iteration into a restart of ``train()``."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from restartable.inprocess import journal
from restartable.inprocess.clock import SYSTEM, Clock
from restartable.inprocess.config import RestartConfig
from restartable.inprocess.errors import FaultRecord
from restartable.inprocess.protocol import fault_records, iteration_end, keys
from restartable.inprocess.protocol.store import Store
from restartable.inprocess.restart.interrupter import Interrupter
from restartable.inprocess.restart.progress import ProgressTracker
from restartable.inprocess.restart.thread_stack import waiting_on_peers, where
from restartable.inprocess.timeouts.sections import Overrun, SectionClock

log = logging.getLogger(__name__)

# How often a delivery deferred by an import in progress is retried.
_DEFER_RETRY_S = 0.005
# At most one "progress" journal record per this many seconds, and only while train() has not
# reported a step (ctx.ping): the downtime report of a script without ping measures from them.
PROGRESS_RECORD_S = 1.0


@dataclass(frozen=True)
class MonitorLimits:
    """How the monitor of an iteration judges and acts, in seconds: ``soft_timeout`` (a main
    thread without progress that long is this rank's fault), ``check_interval`` (how often the
    progress thread looks), ``redeliver_interval`` (a restart not acknowledged is delivered
    again) and ``atomic_timeout`` (how long a restart waits for a ``ctx.atomic()`` block)."""

    soft_timeout: float
    check_interval: float
    redeliver_interval: float
    atomic_timeout: float = 60.0

    @classmethod
    def of(cls, cfg: RestartConfig) -> MonitorLimits:
        """The limits a ``RestartConfig`` gives (the restart loop's monitors)."""
        return cls(
            soft_timeout=cfg.soft_timeout,
            check_interval=min(1.0, cfg.soft_timeout / 10),
            redeliver_interval=max(0.5, min(5.0, cfg.soft_timeout / 2)),
            # A rank frozen that long is lost (hard_timeout's meaning); an atomic block, too.
            atomic_timeout=cfg.hard_timeout,
        )


class Monitor:
    """Owner of the monitor threads of one rank for one restart iteration.

    Call order (main thread): ``interrupter.arm()``, ``start()``, run ``train()``, then
    ``interrupter.disarm()`` and ``close()``. One thread blocks on the iteration's outcome key
    (its own store client, so it never blocks the main thread's store calls; no timed-out waits,
    which c10d logs as warnings; ``give_back`` receives that client once its wait ended). A
    second one checks the main thread's progress every ``check_interval``: a stall longer than
    ``soft_timeout`` (1.5x that while the main thread waits inside a collective, so a hung peer
    is blamed rather than us) is recorded as this rank's fault, which ends the iteration for
    everyone. The same thread judges the open sections (``sections``): one past its timeout is
    recorded as a "section_timeout" of this rank, with the same grace (the limit again) while
    the main thread waits in a collective; it then checks as often as the shortest section limit
    needs (down to 5 ms). When the iteration ends with a fault, the store thread takes
    ``interrupter.lock``, calls ``abort()`` (tear down the process groups, which releases peers
    blocked on this rank) and delivers the restart; it re-delivers every ``redeliver_interval``
    until the main thread acknowledges (disarms).
    """

    def __init__(
        self,
        *,
        store: Store,
        report_store: Store,
        iteration: int,
        give_back: Callable[[Any], None] | None = None,
        initial_rank: int,
        limits: MonitorLimits,
        progress: ProgressTracker,
        interrupter: Interrupter,
        abort: Callable[[], None],
        step: Callable[[], int | None],
        sections: SectionClock | None = None,
        clock: Clock = SYSTEM,
    ) -> None:
        self._store = store
        self._clock = clock
        self._give_back = give_back
        self._report_store = report_store
        self._iteration = iteration
        self._initial_rank = initial_rank
        self._soft_timeout = limits.soft_timeout
        self._progress = progress
        self._interrupter = interrupter
        self._abort = abort
        self._step = step
        self._check_interval = limits.check_interval
        self._redeliver_interval = limits.redeliver_interval
        self._sections = sections
        self._atomic_timeout = limits.atomic_timeout
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.fired_at: float | None = None  # time.time() when this monitor saw the fault
        self.abort_s = 0.0

    def start(self) -> None:
        """Start the threads (once)."""
        for target, name in ((self._watch_store, "store"), (self._watch_progress, "progress")):
            t = threading.Thread(
                target=target, name=f"inprocess-monitor-{name}-{self._iteration}", daemon=True
            )
            t.start()
            self._threads.append(t)

    def _watch_store(self) -> None:
        try:
            result = iteration_end.wait_outcome(
                self._store, self._iteration, timeout=None, clock=self._clock
            )
        except Exception as exc:
            if not self._stop.is_set():
                log.warning("monitor: store unreachable (%r); stops watching", exc)
            return
        if self._give_back is not None:  # no call in flight on it any more
            self._give_back(self._store)
        self._stop.set()  # the iteration is over: the progress thread stops too
        if result == keys.OUTCOME_FAULT:
            self._fire()

    def _watch_progress(self) -> None:
        recorded = float("-inf")  # when the last "progress" record was written
        while not self._stop.wait(self._tick()):
            overrun = self._section_overrun()
            if overrun is not None:
                self._record(
                    kind="section_timeout",
                    detail=overrun.detail(),
                    section=overrun.section,
                    message=f"section timeout: {overrun.detail()}, in:",
                )
                return
            stalled = self._progress.stalled_for()
            soft = self._soft_timeout
            if self._sections is not None:
                soft = self._sections.stall_limit(soft)
            limit = soft
            if stalled > limit and waiting_on_peers(self._interrupter.thread_id):
                limit += soft / 2
            if stalled <= limit:
                self._progress.poke()
                now = self._clock.monotonic()
                if (
                    stalled < self._check_interval * 2
                    and now - recorded >= PROGRESS_RECORD_S
                    and journal.enabled()
                    and self._step() is None
                ):
                    recorded = now
                    journal.record("progress")
                continue
            self._record(
                kind="soft_timeout",
                detail=f"no progress for {stalled:.1f} s (soft_timeout {soft})",
                section="",
                message=f"soft timeout: no progress of the main thread for {stalled:.1f} s, in:",
            )
            return  # the store thread sees the fault and restarts this rank

    def _tick(self) -> float:
        if self._sections is None:
            return self._check_interval
        return self._sections.tick(self._check_interval)

    def _section_overrun(self) -> Overrun | None:
        """An overrun of this rank's own: a rank blocked in a collective behind a hung peer gets
        the limit again as grace, so the hung peer (not waiting on anyone) reports first."""
        if self._sections is None:
            return None
        overrun = self._sections.overrun()
        if overrun is not None and waiting_on_peers(self._interrupter.thread_id):
            overrun = self._sections.overrun(grace=1.0)
        return overrun

    def _record(self, *, kind: str, detail: str, section: str, message: str) -> None:
        log.warning("%s\n%s", message, where(self._interrupter.thread_id))
        try:
            fault_records.record_fault(
                self._store_for_reports(),
                FaultRecord(
                    iteration=self._iteration,
                    initial_rank=self._initial_rank,
                    kind=kind,
                    detail=detail,
                    step=self._step(),
                    time=self._clock.wall(),
                    section=section,
                ),
            )
        except Exception as exc:
            log.warning("monitor: could not record the %s: %r", kind, exc)

    def _store_for_reports(self) -> Any:
        """A separate client: the store thread's connection is busy in its blocking wait."""
        return self._report_store

    def _fire(self) -> None:
        self.fired_at = self._clock.wall()
        # The lock is held by an atomic block (ctx.atomic()) that the restart must not cut.
        # Such a block is meant to be short; one that outlasts the atomic bound is a hang that
        # nothing else could end (its heartbeats go on), so this rank ends itself as a lost one.
        if not self._interrupter.lock.acquire(timeout=self._atomic_timeout):
            self._end_stuck_in_atomic()
            return
        try:
            t0 = self._clock.monotonic()
            self._abort()
            self.abort_s = self._clock.monotonic() - t0
            delivered = self._interrupter.deliver()
        finally:
            self._interrupter.lock.release()
        redeliveries = 0
        while delivered is not False:
            if delivered is None:  # an import in progress: retry as soon as it is done
                if self._interrupter.acked.wait(_DEFER_RETRY_S):
                    return
            elif self._interrupter.acked.wait(self._redeliver_interval):
                return
            else:
                redeliveries += 1
                # Once at WARNING: the main thread is stuck in a C call that does not return
                # (or it swallowed the restart); repeating it every interval only floods logs.
                (log.warning if redeliveries == 1 else log.debug)(
                    "restart not acknowledged after %.1f s: delivering again",
                    redeliveries * self._redeliver_interval,
                )
            delivered = self._interrupter.deliver()

    def _end_stuck_in_atomic(self) -> None:
        """Record why, then SIGKILL this process: its watchdog reports it dead, the others drop
        it at the restart barrier and a warm reserve takes its place (found by the fault
        matrix: a hang inside ctx.atomic() held every rank until the barrier timeout)."""
        detail = (
            f"still inside ctx.atomic() {self._atomic_timeout:.1f} s (atomic_timeout) after a "
            "restart was requested: ended as a hung rank"
        )
        self._record(kind="atomic_timeout", detail=detail, section="", message=detail)
        for handler in logging.getLogger().handlers:
            with contextlib.suppress(Exception):
                handler.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    def close(self) -> None:
        """Stop the threads; waits at most about one ``check_interval`` (idempotent).

        The store thread ends as soon as the iteration has an outcome; until then (a rank that
        leaves mid-iteration) it stays blocked as a daemon and delivers nothing (disarmed).
        """
        self._stop.set()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(self._check_interval + 0.5)
        self._threads = []

    def __enter__(self) -> Monitor:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
