"""``RerunErrorInjector``: corrupts one validated result per chosen step, for drills and tests.

The corrupted value is NaN and always rejected. Which later runs of the step see it depends on
the kind, so the real comparison code reaches each verdict:

* ``transient_error``: only the initial run is corrupted (the re-run in place differs);
* ``persistent_error``: every run on the hardware that was corrupted (the re-run in place
  matches, the re-run on other hardware differs);
* ``correct_result``: every run of that step anywhere (both re-runs match).
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Any

from restartable.rerun.errors import RerunConfigError
from restartable.rerun.state_machine import Diagnostic, State

_KINDS = tuple(d.value for d in Diagnostic)


class RerunErrorInjector:
    """Chooses (rank, iteration) pairs to corrupt: listed in ``at`` or drawn at ``1/rate``.

    ``message`` limits injection to validation calls with that message (default: the first
    validation call of the step). Its state (what was corrupted, where) travels in the state
    machine's checkpoint so that the second half of a persistent drill survives the restart.
    """

    def __init__(
        self,
        kind: str | Diagnostic = Diagnostic.TRANSIENT_ERROR,
        *,
        at: Iterable[tuple[int, int]] = (),
        rate: int = 0,
        message: str | None = None,
        seed: int = 0,
    ) -> None:
        value = kind.value if isinstance(kind, Diagnostic) else kind
        if value not in _KINDS:
            raise RerunConfigError(
                f"error injector kind ({kind!r}) must be one of {list(_KINDS)}: pick one of those"
            )
        if rate < 0:
            raise RerunConfigError(
                f"error injection rate ({rate}) must be >= 0 (0 = off, N = about once every N "
                "steps): use 0 or a positive integer"
            )
        self.kind = Diagnostic(value)
        self._at = {(int(r), int(i)) for r, i in at}
        self._rate = rate
        self._message = message
        self._seed = seed
        # (iteration, message, sequence, hardware_id) of the corrupted call, or None.
        self._injected: tuple[int, str, int, str] | None = None
        self.count = 0  # corruptions of an initial run in this process (for tests and drills)

    def _chosen(self, rank: int, iteration: int) -> bool:
        if (rank, iteration) in self._at:
            return True
        if self._rate <= 0:
            return False
        # Seeded per (rank, iteration): reproducible, and independent of the training RNGs.
        draw = random.Random(self._seed * 1_000_003 + rank * 7919 + iteration).random()
        return draw < 1.0 / self._rate

    def corrupts(
        self, state: State, *, rank: int, iteration: int, message: str, seq: int, hardware_id: str
    ) -> bool:
        """Whether this validation call sees a corrupted (NaN, rejected) result."""
        if state is State.INITIAL_RUN:
            if self._injected is not None and self._injected[0] == iteration:
                return False  # at most one corruption per step
            if self._message is not None and message != self._message:
                return False
            if self._message is None and seq != 0:
                return False
            if not self._chosen(rank, iteration):
                return False
            self._injected = (iteration, message, seq, hardware_id)
            self.count += 1
            return True
        if self._injected is None or self._injected[:3] != (iteration, message, seq):
            return False
        if self.kind is Diagnostic.TRANSIENT_ERROR:
            return False
        if self.kind is Diagnostic.PERSISTENT_ERROR:
            return hardware_id == self._injected[3]
        return True

    def state(self) -> dict[str, Any]:
        return {"injected": list(self._injected) if self._injected else None}

    def load(self, state: dict[str, Any]) -> None:
        inj = state.get("injected")
        self._injected = (int(inj[0]), str(inj[1]), int(inj[2]), str(inj[3])) if inj else None
