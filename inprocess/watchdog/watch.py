"""The watchdog's decision: from heartbeats, the pipe's end and the rank's death to a report.

``Watch`` holds no file or socket: the process's loop (``inprocess.watchdog.process``) does the
waiting and hands it what arrived, so a test drives every decision on a fake clock.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from restartable.inprocess.clock import SYSTEM, Clock
from restartable.inprocess.errors import FaultRecord
from restartable.inprocess.protocol.store import Store
from restartable.inprocess.watchdog.pipe import CLOSE_MESSAGE, parse_beat
from restartable.inprocess.watchdog.watched_rank import Rank, terminate

log = logging.getLogger("restartable.inprocess.watchdog.process")  # the process's one log channel


@dataclass(frozen=True)
class Verdict:
    """What the watchdog decided: ``kind`` "dead" or "hard_timeout" (the fault record's kind)
    of ``initial_rank`` in ``iteration``; ``reserve``: the rank waited as a reserve."""

    kind: str
    detail: str
    initial_rank: int
    iteration: int
    reserve: bool


class Watch:
    """One rank's watch, from the first beat to the one verdict (or the rank's close).

    Call order (the watchdog process's loop): ``wait_s()`` bounds each wait for input; then
    ``step(chunk, eof=..., gone=...)`` with what arrived (``b""`` when nothing did). ``step``
    returns "close" when the rank closed its watchdog, a ``Verdict`` once one was taken and
    reported, else None (go on watching). A hard timeout blocks ``step`` for the kill
    (``watched_rank.terminate``: up to the grace time plus the SIGKILL wait).
    """

    def __init__(
        self,
        *,
        initial_rank: int,
        iteration: int,
        reserve: bool,
        hard_timeout: float,
        grace: float,
        rank: Rank,
        report: Callable[[Verdict], None],
        clock: Clock = SYSTEM,
    ) -> None:
        self.initial_rank = initial_rank
        self.iteration = iteration
        self.reserve = reserve
        self._hard_timeout = hard_timeout
        self._grace = grace
        self._rank = rank
        self._report = report
        self._clock = clock
        self._buffer = b""
        self._last_beat = clock.monotonic()

    def wait_s(self) -> float:
        """How long the loop may wait for input before the hard timeout is due (>= 0)."""
        return max(0.0, self._last_beat + self._hard_timeout - self._clock.monotonic())

    def step(self, chunk: bytes, *, eof: bool, gone: bool) -> Verdict | str | None:
        """Judge what arrived: ``chunk`` read from the pipe, ``eof`` (the pipe closed), ``gone``
        (the rank process ended). Input is judged first: a "close" written just before the
        rank exited wins over the death notice that arrives with it."""
        if self._feed(chunk):
            log.debug("rank %d closed its watchdog", self.initial_rank)
            return "close"
        if eof or gone:
            return self._decide("dead", f"rank process {self._rank.pid} disappeared")
        if self._clock.monotonic() - self._last_beat >= self._hard_timeout:
            detail = terminate(self._rank, self._grace)
            return self._decide(
                "hard_timeout",
                f"no heartbeat for {self._hard_timeout} s (GIL held or process frozen); {detail}",
            )
        return None

    def _feed(self, chunk: bytes) -> bool:
        """Take the beats in ``chunk``; True when the rank closed its watchdog."""
        self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            if line + b"\n" == CLOSE_MESSAGE:
                return True
            try:
                self.iteration, self.reserve = parse_beat(line)
            except ValueError:  # not ours (a stray write): keep watching, it was a beat
                log.warning("ignoring unexpected input %r", line[:80])
        if lines:
            self._last_beat = self._clock.monotonic()
        return False

    def _decide(self, kind: str, detail: str) -> Verdict:
        verdict = Verdict(kind, detail, self.initial_rank, self.iteration, self.reserve)
        self._report(verdict)
        return verdict


class StoreReport:
    """``Watch``'s ``report`` in the watchdog process: ``report_to`` the job's store, through
    ``store``, or when there was none (the first connect failed) through a client ``connect()``
    opens then (None again: logged only)."""

    def __init__(
        self, store: Store | None, *, connect: Callable[[], Store | None], clock: Clock = SYSTEM
    ) -> None:
        self._store, self._connect, self._clock = store, connect, clock

    def __call__(self, verdict: Verdict) -> None:
        store = self._store if self._store is not None else self._connect()
        report_to(store, verdict, clock=self._clock)


def report_to(store: Store | None, verdict: Verdict, *, clock: Clock = SYSTEM) -> None:
    """Log ``verdict`` and record it in ``store`` (None: logged only): a reserve's death only
    marks it gone (``fault_records.record_reserve_gone``: it must not interrupt the ranks that
    train), any other verdict is a fault record that ends its iteration
    (``fault_records.record_fault``)."""
    who = "reserve rank" if verdict.reserve else "rank"
    log.warning(
        "%s %d iteration %d: %s (%s)",
        who,
        verdict.initial_rank,
        verdict.iteration,
        verdict.kind,
        verdict.detail,
    )
    if store is None:
        return
    try:
        from restartable.inprocess.protocol.fault_records import record_fault, record_reserve_gone

        if verdict.reserve:
            record_reserve_gone(store, verdict.iteration, verdict.initial_rank)
            return
        record_fault(
            store,
            FaultRecord(
                iteration=verdict.iteration,
                initial_rank=verdict.initial_rank,
                kind=verdict.kind,
                detail=verdict.detail,
                step=None,
                time=clock.wall(),
            ),
        )
    except (OSError, RuntimeError) as exc:  # the store is gone (its host lost): one line
        log.error(
            "could not report %s of rank %d to the store: %s",
            verdict.kind,
            verdict.initial_rank,
            exc,
        )
    except Exception:
        log.exception(
            "could not report %s of rank %d to the store", verdict.kind, verdict.initial_rank
        )
