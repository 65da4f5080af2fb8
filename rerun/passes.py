"""What one pass of a step records and how it ends: the validation calls made inside
forward/backward, then the flags every rank agrees on after it.

Owned by ``RerunStateMachine`` (``rerun.machine``), one per machine, used on the training loop's
thread: ``validate`` during a pass (never blocks; a tensor stays on its device), ``end_pass``
once per pass from ``should_run_forward_backward`` (one collective on every rank; the step's
single device-to-host read).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch

from restartable.rerun import agree, tracker
from restartable.rerun.checks import Rejection, Value, as_float
from restartable.rerun.errors import RerunConfigError
from restartable.rerun.injector import RerunErrorInjector
from restartable.rerun.record import StepRecord
from restartable.rerun.state_machine import NUM_FLAGS, Flag, RerunMode, State
from restartable.rerun.stats import QuickStats

logger = logging.getLogger(__name__)

REPORT_INTERVAL_ITERATIONS = 100  # determinism stats are logged every this many steps

# A validate_result call outside forward/backward (before the loop, or after it) records nothing.
_BETWEEN_STEPS = (State.IDLE, State.WILL_RERUN_ELSEWHERE)


class PassChecks:
    """The step's record (``rec``), the determinism stats per message (``stats``), and the
    tracker file of rejections."""

    def __init__(
        self,
        mode: RerunMode,
        *,
        injector: RerunErrorInjector | None,
        tracker_path: str | None,
        rank: Callable[[], int],
        hardware_id: Callable[[], str],
    ) -> None:
        """``tracker_path``: the JSON-lines file of rejections (checked for writability now), or
        None. ``rank`` / ``hardware_id``: read when needed (the rank changes when the process
        group does; the default hardware id asks torch which device is current)."""
        self.mode = mode
        self._rank, self._hardware_id = rank, hardware_id
        self.injector = injector
        self.tracker = tracker.ResultTracker(tracker_path) if tracker_path is not None else None
        self.rec = StepRecord()
        self.stats: dict[str, QuickStats] = {}

    def validate(
        self,
        value: Value,
        rejection_func: Callable[[Value], Rejection],
        message: str,
        *,
        tolerance: float,
        fatal: bool,
        comparison_func: Callable[[float, float], float],
        state: State,
        iteration: int,
    ) -> None:
        """Record one ``validate_result`` call made in ``state`` (nothing when disabled or
        between steps). Raises ``RerunConfigError`` for a value of several elements."""
        if self.mode is RerunMode.DISABLED or state in _BETWEEN_STEPS:
            return
        if isinstance(value, torch.Tensor) and value.numel() != 1:
            raise RerunConfigError(
                f"validate_result value for {message!r} has {value.numel()} elements; it must be "
                "a number or a one-element tensor: reduce it first (e.g. .sum() or a norm)"
            )
        rec = self.rec
        seq = rec.next_seq(message)
        corrupt = self._injects(state, iteration=iteration, message=message, seq=seq)
        if isinstance(value, torch.Tensor):
            value = value.detach()  # keep the number, not the autograd graph
        if corrupt:
            value = math.nan
        if state is State.INITIAL_RUN:
            if self.mode is RerunMode.REPORT_DETERMINISM_STATS:
                rec.add_initial(message, seq, fatal, tolerance, value, False)
                return
            flag: Rejection = True if corrupt else rejection_func(value)
            rec.add_initial(message, seq, fatal, tolerance, value, flag)
            return
        # A re-run: compare on the rank and call that were rejected (or every call for stats).
        if self.mode is RerunMode.REPORT_DETERMINISM_STATS:
            first = rec.first_results.get((message, seq))
            if first is not None:
                diff = comparison_func(first, as_float(value))
                self.stats.setdefault(message, QuickStats()).add(diff)
            return
        rec.add_rerun(message, seq, value, comparison_func)

    def _injects(self, state: State, *, iteration: int, message: str, seq: int) -> bool:
        """Whether the error injector corrupts this call (its value becomes NaN), logged."""
        injector = self.injector
        if injector is None or not injector.corrupts(
            state,
            rank=self._rank(),
            iteration=iteration,
            message=message,
            seq=seq,
            hardware_id=self._hardware_id(),
        ):
            return False
        logger.warning(
            "iteration %d: injecting a %s into %r", iteration, injector.kind.value, message
        )
        return True

    def end_pass(self, state: State, *, iteration: int) -> frozenset[Flag]:
        """This rank's outcome of the pass, agreed with every rank (one collective)."""
        rec = self.rec
        if self.mode is RerunMode.DISABLED:
            return frozenset()
        if self.mode is RerunMode.REPORT_DETERMINISM_STATS:
            if state is State.INITIAL_RUN:
                rec.first_results = {(m, s): as_float(v) for m, s, _f, _t, v in rec.calls}
            return frozenset()
        if state is State.INITIAL_RUN:
            flags = rec.read_initial(agree.comm_device())
            if rec.rejected is not None:
                r = rec.rejected
                logger.warning(
                    "rank %d iteration %d: result %r rejected (%r, %s); re-running the step",
                    self._rank(),
                    iteration,
                    r.message,
                    r.initial,
                    "fatal" if r.fatal else "non-fatal",
                )
                self.track(tracker.INITIAL_RUN, r.initial, r.message, iteration)
            return flags
        local = torch.zeros(NUM_FLAGS, dtype=torch.int32, device=agree.comm_device())
        bit = self._rerun_outcome(state, iteration=iteration)
        if bit is not None:
            local[bit] = 1
        agree.reduce_max_(local)
        return frozenset(f for f, v in zip(Flag, local.tolist(), strict=True) if v)

    def _rerun_outcome(self, state: State, *, iteration: int) -> Flag | None:
        """The flag this rank contributes after a re-run, logged and tracked."""
        rec, r = self.rec, self.rec.rejected
        in_place = state is State.RERUN_IN_PLACE
        flag, status = rec.rerun_outcome(in_place=in_place, hardware_id=self._hardware_id())
        if r is None:
            return flag
        if status:
            self.track(status, rec.rerun_result, r.message, iteration)
        where = "on the same hardware" if in_place else f"on {self._hardware_id()}"
        what = (
            "same hardware again"
            if flag is Flag.SAME_HARDWARE
            else ("reproduced" if rec.reproduced() else "did not reproduce")
        )
        logger.warning(
            "rank %d iteration %d: %r %s %s%s",
            self._rank(),
            iteration,
            r.message,
            what,
            where,
            "" if r.fatal else " (non-fatal: continuing with the re-run's result)",
        )
        return flag

    def track(self, status: str, result: float, message: str, iteration: int) -> None:
        """One line in the tracker file of rejections (when the machine has one)."""
        if self.tracker is not None:
            self.tracker.record(
                rank=self._rank(),
                iteration=iteration,
                status=status,
                result=result,
                message=message,
                hardware_id=self._hardware_id(),
            )

    def log_stats(self, iteration: int) -> None:
        """In ``report_determinism_stats`` mode, every ``REPORT_INTERVAL_ITERATIONS`` steps:
        the determinism stats of every message so far, one INFO line each."""
        if self.mode is not RerunMode.REPORT_DETERMINISM_STATS:
            return
        if iteration % REPORT_INTERVAL_ITERATIONS != 0:
            return
        for msg, st in sorted(self.stats.items()):
            logger.info(
                "determinism stats at iteration %d for %r: %s",
                iteration,
                msg,
                st.summary(),
            )
