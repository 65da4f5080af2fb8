"""Section timing of one rank: ``ctx.section(name)``, the overrun check, ``ft_state.json`` upkeep.

Owned by the restart loop for the life of the rank (the learned timeouts outlive iterations);
the main thread opens and closes sections, the monitor thread asks ``overrun()``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from restartable.inprocess.clock import SYSTEM, Clock
from restartable.inprocess.config import RestartConfig
from restartable.inprocess.errors import SectionError
from restartable.inprocess.timeouts.estimator import (
    KEYS,
    OUT_OF_SECTION,
    SECTIONS,
    TimeoutEstimator,
)
from restartable.inprocess.timeouts.state_file import read_state, write_state

log = logging.getLogger(__name__)

_MIN_TICK_S = 0.005  # the monitor's finest check interval: a 5 ms poll is still cheap
_TICKS_PER_LIMIT = 8  # an overrun is seen within 1/8 of its limit
_WRITE_EVERY_S = 10.0  # ft_state.json is rewritten at most this often while values move
_REWRITE_CHANGE = 0.05  # ...and only when a value moved by more than 5 %


def section_clock(cfg: RestartConfig) -> SectionClock:
    """The section clock of one rank for ``cfg`` (the restart loop creates one per rank)."""
    estimator = TimeoutEstimator(
        safety_factor=cfg.safety_factor,
        configured=cfg.section_limits,
        # setup and the gaps between sections are irregular: their learned limits never
        # undercut the soft timeout (timeouts.IRREGULAR).
        soft_floor=cfg.soft_timeout,
    )
    path = cfg.timeouts_state_path
    return SectionClock(
        estimator=estimator,
        learn=cfg.calculate_timeouts,
        state_path=None if path is None else str(path),
    )


@dataclass(frozen=True)
class Overrun:
    """A section (or out-of-section gap) that ran past its limit."""

    section: str
    elapsed: float
    limit: float
    source: str  # "configured", "learned" or "stored"

    def detail(self) -> str:
        """The fault record's detail."""
        return (
            f"section {self.section!r} ran {self.elapsed:.3f} s, past its {self.source} "
            f"timeout of {self.limit:.3f} s"
        )


class SectionClock:
    """Times the sections of the thread running ``train()`` and judges them.

    Call order: ``begin_iteration()`` before each ``train()`` call (reads ``ft_state.json`` and
    resets the warm-up), ``section()`` inside it (that thread only), ``end_iteration()`` as soon
    as ``train()`` left (stops judging, writes the file on the writer rank). ``overrun()`` and
    ``stall_limit()`` may be called from any thread at any time and never block on I/O.
    """

    def __init__(
        self,
        *,
        estimator: TimeoutEstimator,
        learn: bool,
        state_path: str | None,
        clock: Clock = SYSTEM,
    ) -> None:
        self._est = estimator
        self._learn = learn
        self._path = state_path
        self._clock = clock
        self._lock = threading.Lock()
        self._open: dict[str, float] = {}  # name -> start, in opening order
        self._gap_start: float | None = None  # out of section since; None before the first
        self._running = False
        self._thread_id = threading.get_ident()
        self._writer = False
        self._written: dict[str, float] = {}
        self._written_version = -1
        self._last_write = -float("inf")
        self._write_failed = False

    @property
    def estimator(self) -> TimeoutEstimator:
        """The estimator behind the limits (read-only use)."""
        return self._est

    def begin_iteration(self, *, writer: bool) -> None:
        """Before ``train()``: ``writer`` (active rank 0) keeps ``ft_state.json`` up to date."""
        stored = read_state(self._path) if (self._learn and self._path) else {}
        with self._lock:
            self._est.begin_iteration(stored)
            self._open.clear()
            self._gap_start = None
            self._running = True
            self._writer = writer
            self._thread_id = threading.get_ident()

    def end_iteration(self) -> None:
        """``train()`` returned, raised or was interrupted: nothing is judged until the next
        ``begin_iteration``; the writer persists what was learned."""
        with self._lock:
            self._running = False
            self._open.clear()
            self._gap_start = None
        self._persist(force=True)

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        """Time ``name`` (one of ``SECTIONS``); see ``RestartContext.section``."""
        if name not in SECTIONS:
            raise SectionError(
                f"section name ({name!r}) must be one of {SECTIONS}: rename the section (code "
                "outside every section is judged by rank_out_of_section_timeout)"
            )
        if threading.get_ident() != self._thread_id:
            raise SectionError(
                f"section {name!r} opened from thread {threading.current_thread().name!r}: "
                "sections time the thread that runs train(); open them there"
            )
        with self._lock:
            if name in self._open:
                raise SectionError(
                    f"section {name!r} opened inside itself: close it before opening it again "
                    "(different sections may nest)"
                )
            now = self._clock.monotonic()
            if not self._open and self._gap_start is not None and self._running:
                self._observe(OUT_OF_SECTION, now - self._gap_start)
            self._gap_start = None
            self._open[name] = now
        completed = False
        try:
            yield
            completed = True
        finally:
            with self._lock:
                start = self._open.pop(name, None)
                end = self._clock.monotonic()
                # Only a section that ended normally is a duration: one cut short by an exception
                # or a restart says nothing about how long the section takes.
                if completed and start is not None and self._running:
                    self._observe(name, end - start)
                if not self._open and self._running:
                    self._gap_start = end
        if completed:
            self._persist(force=False)

    def _observe(self, key: str, seconds: float) -> None:
        if self._learn:  # configured timeouts alone apply from the first call: nothing to learn
            self._est.observe(key, seconds)

    def overrun(self, *, grace: float = 0.0) -> Overrun | None:
        """The first open section (or the current gap) past ``(1 + grace) x`` its limit."""
        if not self._running:
            return None
        with self._lock:
            now = self._clock.monotonic()
            spans = list(self._open.items())
            if not spans and self._gap_start is not None:
                spans = [(OUT_OF_SECTION, self._gap_start)]
            for name, start in spans:
                limit = self._est.limit(name)
                if limit.seconds is not None and now - start > limit.seconds * (1.0 + grace):
                    return Overrun(name, now - start, limit.seconds, limit.source)
        return None

    def stall_limit(self, soft_timeout: float) -> float:
        """How long the main thread may show no progress now: ``soft_timeout``, or a longer
        configured timeout of an open section (inside it, the section's timeout governs)."""
        if not self._running:
            return soft_timeout
        with self._lock:
            names = list(self._open) or ([OUT_OF_SECTION] if self._gap_start is not None else [])
        configured = [self._est.configured.get(n) for n in names]
        return max([soft_timeout, *(c for c in configured if c is not None)])

    def limits(self) -> dict[str, tuple[float, str]]:
        """``{key: (seconds, source)}`` of every key with a limit now (for logs and users)."""
        out = {}
        for key in KEYS:
            limit = self._est.limit(key)
            if limit.seconds is not None:
                out[key] = (limit.seconds, limit.source)
        return out

    def tick(self, default: float) -> float:
        """The monitor's check interval: fine enough to see an overrun of the shortest limit."""
        limits = [self._est.limit(k).seconds for k in KEYS]
        shortest = min((s for s in limits if s is not None), default=None)
        if shortest is None:
            return default
        return max(_MIN_TICK_S, min(default, shortest / _TICKS_PER_LIMIT))

    def _persist(self, *, force: bool) -> None:
        """Write ``ft_state.json`` (writer rank) when the learned values moved enough."""
        if not (self._writer and self._learn and self._path and not self._write_failed):
            return
        if self._est.version == self._written_version and not force:
            return  # nothing learned since the last look: the per-step cost stays tiny
        self._written_version = self._est.version
        learned = self._est.learned()
        if not learned or learned == self._written:
            return
        now = self._clock.monotonic()
        new_keys = set(learned) != set(self._written)
        moved = any(
            abs(v - self._written.get(k, 0.0)) > _REWRITE_CHANGE * v for k, v in learned.items()
        )
        if not (force or new_keys or (moved and now - self._last_write >= _WRITE_EVERY_S)):
            return
        try:
            write_state(
                self._path, learned, safety_factor=self._est.safety_factor, clock=self._clock
            )
        except OSError as exc:
            self._write_failed = True
            log.warning(
                "cannot write the timeouts state file %s (%s): computed timeouts are not kept "
                "for the next launch",
                self._path,
                exc,
            )
            return
        self._written, self._last_write = learned, now
        log.info(
            "section timeouts learned: %s (written to %s)",
            ", ".join(f"{k} {v:.3f} s" for k, v in sorted(learned.items())),
            self._path,
        )
