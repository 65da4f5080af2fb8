"""States of the re-run state machine and its pure transition function (no I/O, no torch).

The driver (``machine.py``) calls ``transition`` once per ``should_run_forward_backward`` call:
``Event.BEGIN`` before a step, ``Event.END`` after a pass once every rank agreed on ``flags``.
``exit_decision`` maps the state after the loop to ``(checkpoint, exit, code)``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from restartable.rerun.errors import InvalidTransition

EXIT_CODE_RESUME_TO_DISAMBIGUATE = 16
EXIT_CODE_FAILED_ON_RESULT_VALIDATION = 17


class RerunMode(str, enum.Enum):
    """What the machine does with each step."""

    DISABLED = "disabled"  # run each step once, check nothing
    VALIDATE_RESULTS = "validate_results"  # check results; re-run a step only when one is rejected
    REPORT_DETERMINISM_STATS = "report_determinism_stats"  # re-run every step, record differences


class Diagnostic(str, enum.Enum):
    """The verdict on a rejected result."""

    TRANSIENT_ERROR = "transient_error"  # not reproducible on the same hardware
    PERSISTENT_ERROR = "persistent_error"  # reproducible here, different on other hardware
    CORRECT_RESULT = "correct_result"  # same on other hardware: the model/data produced it


class State(str, enum.Enum):
    IDLE = "idle"  # between steps
    INITIAL_RUN = "initial_run"  # first execution of the step
    RERUN_IN_PLACE = "rerun_in_place"  # same step, same RNG and data, same hardware
    WILL_RERUN_ELSEWHERE = "will_rerun_elsewhere"  # checkpoint, exit 16, resume elsewhere
    RERUN_ELSEWHERE = "rerun_elsewhere"  # the resumed job re-executes the saved step
    EXIT_FAILED = "exit_failed"  # verdict reached (or transient fatal): exit 17, no checkpoint
    EXIT_RESUME_ELSEWHERE = "exit_resume_elsewhere"  # resumed on the suspect hardware: exit 16


class Event(str, enum.Enum):
    BEGIN = "begin"  # should_run_forward_backward before a step
    END = "end"  # should_run_forward_backward after a pass


class Flag(enum.IntEnum):
    """Positions in the per-pass vector that all ranks reduce with MAX (an element-wise OR)."""

    REJECTED = 0  # initial run: some rank rejected a result
    FATAL_REPRODUCED = 1  # in place: a fatal rejection reproduced
    FATAL_NOT_REPRODUCED = 2  # in place: a fatal rejection did not reproduce
    SAME_HARDWARE = 3  # elsewhere: the suspect's work landed on the suspect hardware again
    DIFFERS_ELSEWHERE = 4  # elsewhere: the result differs on other hardware
    SAME_ELSEWHERE = 5  # elsewhere: the result is the same on other hardware


NUM_FLAGS = len(Flag)


@dataclass(frozen=True)
class Transition:
    """What the driver does next. ``run`` is the return value of should_run_forward_backward."""

    state: State
    run: bool
    capture: bool = False  # snapshot RNG and start recording microbatches
    replay: bool = False  # restore the snapshot and rewind the recorded microbatches
    verdict: Diagnostic | None = None


def transition(
    state: State,
    event: Event,
    mode: RerunMode,
    flags: frozenset[Flag] = frozenset(),
    *,
    continue_on_persistent: bool = False,
) -> Transition:
    """The next state. Pure: the same inputs always give the same output.

    ``flags`` are the agreed (OR-reduced over ranks) outcome of the pass that just ended; they
    are ignored on ``BEGIN``. ``continue_on_persistent`` (in-job use, see the README): after a
    persistent-fault verdict the suspect's work already runs on healthy hardware, so training
    continues with that re-run's result instead of exiting with 17.
    """
    if event is Event.BEGIN:
        return _begin(state, mode)
    return _end(state, mode, flags, continue_on_persistent)


def _begin(state: State, mode: RerunMode) -> Transition:
    if state is State.IDLE:
        return Transition(State.INITIAL_RUN, run=True, capture=mode is not RerunMode.DISABLED)
    if state is State.WILL_RERUN_ELSEWHERE:
        if mode is not RerunMode.VALIDATE_RESULTS:
            # A pending re-run loaded into a machine that does not validate: run normally.
            return Transition(State.INITIAL_RUN, run=True, capture=mode is not RerunMode.DISABLED)
        return Transition(State.RERUN_ELSEWHERE, run=True, replay=True)
    raise InvalidTransition(
        f"should_run_forward_backward() called to start a step in state {state.value}: "
        + (
            "a verdict asked this job to exit; call should_checkpoint_and_exit() and stop"
            if state in (State.EXIT_FAILED, State.EXIT_RESUME_ELSEWHERE)
            else "the previous step has not finished"
        )
    )


def _end(
    state: State, mode: RerunMode, flags: frozenset[Flag], continue_on_persistent: bool
) -> Transition:
    if state is State.INITIAL_RUN:
        if mode is RerunMode.REPORT_DETERMINISM_STATS:
            return Transition(State.RERUN_IN_PLACE, run=True, replay=True)
        if mode is RerunMode.VALIDATE_RESULTS and Flag.REJECTED in flags:
            return Transition(State.RERUN_IN_PLACE, run=True, replay=True)
        return Transition(State.IDLE, run=False)
    if state is State.RERUN_IN_PLACE:
        if mode is not RerunMode.VALIDATE_RESULTS:
            return Transition(State.IDLE, run=False)
        if Flag.FATAL_REPRODUCED in flags:
            # Restore the step's start state so the checkpoint the caller now writes holds the
            # RNG and the microbatches of this step, before the optimizer step.
            return Transition(State.WILL_RERUN_ELSEWHERE, run=False, replay=True)
        if Flag.FATAL_NOT_REPRODUCED in flags:
            return Transition(State.EXIT_FAILED, run=False, verdict=Diagnostic.TRANSIENT_ERROR)
        # Non-fatal rejections (e.g. a spiky loss): continue with the re-run's result.
        return Transition(State.IDLE, run=False)
    if state is State.RERUN_ELSEWHERE:
        if Flag.SAME_HARDWARE in flags:
            return Transition(State.EXIT_RESUME_ELSEWHERE, run=False)
        if Flag.DIFFERS_ELSEWHERE in flags:
            if continue_on_persistent:
                return Transition(State.IDLE, run=False, verdict=Diagnostic.PERSISTENT_ERROR)
            return Transition(State.EXIT_FAILED, run=False, verdict=Diagnostic.PERSISTENT_ERROR)
        if Flag.SAME_ELSEWHERE in flags:
            return Transition(State.EXIT_FAILED, run=False, verdict=Diagnostic.CORRECT_RESULT)
        return Transition(State.IDLE, run=False)
    raise InvalidTransition(
        f"should_run_forward_backward() ended a pass in state {state.value}, where no pass runs"
    )


def exit_decision(state: State) -> tuple[bool, bool, int]:
    """``(checkpoint, exit, code)`` for the state after the forward/backward loop."""
    if state is State.WILL_RERUN_ELSEWHERE:
        return True, True, EXIT_CODE_RESUME_TO_DISAMBIGUATE
    if state is State.EXIT_RESUME_ELSEWHERE:
        # Never overwrite the checkpoint that holds the pending re-run.
        return False, True, EXIT_CODE_RESUME_TO_DISAMBIGUATE
    if state is State.EXIT_FAILED:
        return False, True, EXIT_CODE_FAILED_ON_RESULT_VALIDATION
    return False, False, 0


def persisted_state(state: State) -> State:
    """The state a checkpoint records: one that a fresh process can resume from disk alone.

    Only a pending re-run on other hardware is worth carrying; every other state resumes as
    ``IDLE`` (a saved mid-step or exit state would need in-memory context that is gone).
    """
    if state in (State.WILL_RERUN_ELSEWHERE, State.RERUN_ELSEWHERE, State.EXIT_RESUME_ELSEWHERE):
        return State.WILL_RERUN_ELSEWHERE
    return State.IDLE
