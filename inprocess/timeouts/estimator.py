"""Computed section timeouts: a pure estimator from observed durations to enforced limits.

No clock, no I/O, no threads: ``inprocess.timeouts.sections`` feeds it durations (main thread) and
reads
its limits (monitor thread); ``inprocess.timeouts.state_file`` persists what it learned.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

SECTIONS = ("setup", "step", "checkpointing")
OUT_OF_SECTION = "out_of_section"
KEYS = (*SECTIONS, OUT_OF_SECTION)

# Observations of each iteration (launch or restart) that are never used nor judged by a learned
# value: the first steps absorb lazy imports, DDP's bucket rebuild and peers' start-up; the first
# save allocates staging buffers. setup happens once per iteration, so it has no warm-up: its
# estimate is the max over every setup seen, the launch's (the slowest) included.
WARMUP = {"setup": 0, "step": 5, "checkpointing": 1, OUT_OF_SECTION: 5}
# Own observations (after warm-up) needed before a learned value is enforced.
MIN_SAMPLES = {"setup": 1, "step": 10, "checkpointing": 2, OUT_OF_SECTION: 10}
# Smallest learned value (seconds): below ~0.1 s, scheduler jitter on a loaded host is the
# duration. checkpointing mixes cheap local saves with rarer persistent ones, so a learned value
# must leave room for the first persistent save seen after only local ones.
FLOOR = {"setup": 1.0, "step": 0.1, "checkpointing": 1.0, OUT_OF_SECTION: 0.1}
# Irregular keys: setup's length depends on which tier the state comes back from and on peers
# importing and building for the first time (a reserve that joins); code between sections
# includes logging and evaluation every N steps. Learning only tightens a configured bound for
# them, and never below ``soft_floor`` (the soft timeout): unconfigured, the soft timeout (which
# spares code that makes progress) stays their only judge.
IRREGULAR = ("setup", OUT_OF_SECTION)
# Headroom a stored value must leave over each duration this run measures to stay enforced: a
# stored value is safety_factor x an earlier run's longest duration, so asking for the full
# safety factor would reject it at the first step a little slower than that one.
STORED_MARGIN = 2.0


@dataclass(frozen=True, kw_only=True)
class Limits:
    """What the monitor enforces for one key: ``seconds`` (None: nothing) and where it came from
    (``"configured"``, ``"learned"`` or ``"stored"`` for a value read from ``ft_state.json``)."""

    seconds: float | None
    source: str = ""


@dataclass
class _Key:
    """The learning state of one section (or the out-of-section gaps)."""

    seen_this_iteration: int = 0
    samples: int = 0  # own observations after warm-up, every iteration of this process
    max_seen: float = 0.0
    stored: float | None = None  # read from ft_state.json, not yet confirmed or rejected
    stored_confirmed: bool = False


@dataclass
class TimeoutEstimator:
    """Per-key timeouts: configured upper bounds, tightened by what this rank observes.

    Call order (one rank): ``begin_iteration(stored)`` before each ``train()`` call (launch and
    every restart), ``observe(key, seconds)`` for each completed section or out-of-section gap,
    ``limit(key)`` any time from any thread (reads only), ``learned()`` to persist.

    Rules, per key:

    * learned value = ``max(floor, safety_factor x max(observed))``, over this process's
      observations after the per-iteration warm-up, once ``MIN_SAMPLES`` of them exist;
    * the configured value (``rank_section_timeouts`` / ``rank_out_of_section_timeout``) is an
      upper bound: the enforced limit is ``min(configured, learned)``;
    * warm-up observations are neither used nor judged by a learned value (configured only);
    * a value read from ``ft_state.json`` (``stored``) is enforced only once this process has
      seen the section after warm-up and the durations fit with room to spare (each
      ``duration x STORED_MARGIN <= stored``); a duration that does not fit marks it stale: it
      is dropped (WARNING) and the key is learned again. So a file from a faster model never
      judges a step of the new one before that step has been measured;
    * the ``IRREGULAR`` keys (``setup``, ``out_of_section``) are learned only when a bound is
      configured for them, and never below ``soft_floor`` (the soft timeout).
    """

    safety_factor: float = 5.0
    configured: Mapping[str, float] = field(default_factory=dict)
    soft_floor: float = 0.0
    _keys: dict[str, _Key] = field(default_factory=lambda: {k: _Key() for k in KEYS})
    # Bumped whenever learned() may have changed, so callers can skip recomputing it per step.
    version: int = 0

    def begin_iteration(self, stored: Mapping[str, float] | None = None) -> None:
        """Start a ``train()`` call: reset the warm-up counts; adopt ``stored`` values for keys
        that have no estimate of their own yet (own observations beat a file)."""
        self.version += 1
        for key, state in self._keys.items():
            state.seen_this_iteration = 0
            value = (stored or {}).get(key)
            if value is None or state.samples >= MIN_SAMPLES[key]:
                continue
            if state.stored != value:
                state.stored, state.stored_confirmed = value, False

    def observe(self, key: str, seconds: float) -> None:
        """One completed section (or out-of-section gap) of ``seconds`` (main thread)."""
        state = self._keys[key]
        state.seen_this_iteration += 1
        if state.seen_this_iteration <= WARMUP[key]:
            return
        state.samples += 1
        if seconds > state.max_seen or state.samples == MIN_SAMPLES[key]:
            self.version += 1
        state.max_seen = max(state.max_seen, seconds)
        if state.stored is not None:
            margin = min(STORED_MARGIN, self.safety_factor)
            if seconds * margin > state.stored:
                log.warning(
                    "stored timeout of %s (%.3f s, from ft_state.json) no longer fits: a %.3f s "
                    "run leaves less than %.1fx headroom; it is dropped and learned again",
                    key,
                    state.stored,
                    seconds,
                    margin,
                )
                state.stored, state.stored_confirmed = None, False
                self.version += 1
            else:
                state.stored_confirmed = True

    def _learned(self, key: str) -> float | None:
        state = self._keys[key]
        if state.samples < MIN_SAMPLES[key]:
            return None
        if key in IRREGULAR and key not in self.configured:
            return None
        floor = max(FLOOR[key], self.soft_floor) if key in IRREGULAR else FLOOR[key]
        return max(floor, self.safety_factor * state.max_seen)

    def in_warmup(self, key: str) -> bool:
        """The key's current observation would be a warm-up one (judged by configured only)."""
        return self._keys[key].seen_this_iteration < WARMUP[key]

    def limit(self, key: str) -> Limits:
        """The limit enforced now on an open ``key`` (the next observation's judge)."""
        configured = self.configured.get(key)
        best = Limits(seconds=configured, source="configured" if configured else "")
        if self.in_warmup(key):
            return best
        state = self._keys[key]
        learned = self._learned(key)
        candidate: Limits | None = None
        if learned is not None:
            candidate = Limits(seconds=learned, source="learned")
        elif state.stored is not None and state.stored_confirmed:
            candidate = Limits(seconds=state.stored, source="stored")
        if candidate is None or candidate.seconds is None:
            return best
        if best.seconds is None or candidate.seconds < best.seconds:
            return candidate
        return best

    def learned(self) -> dict[str, float]:
        """What this rank would start the next launch from (for ``ft_state.json``): its own
        learned values, else a stored value this run did not reject; bounded by configured."""
        out: dict[str, float] = {}
        for key, state in self._keys.items():
            value = self._learned(key)
            if value is None and state.stored is not None:
                value = state.stored
            if value is None:
                continue
            configured = self.configured.get(key)
            out[key] = min(value, configured) if configured else value
        return out
