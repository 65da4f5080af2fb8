"""Every transition of the pure re-run state machine, and the exit decision of every state."""

from __future__ import annotations

import pytest

from restartable.rerun.errors import InvalidTransition
from restartable.rerun.state_machine import (
    Diagnostic,
    Event,
    Flag,
    RerunMode,
    State,
    Transition,
    exit_decision,
    persisted_state,
    transition,
)

V, R, D = RerunMode.VALIDATE_RESULTS, RerunMode.REPORT_DETERMINISM_STATS, RerunMode.DISABLED
B, E = Event.BEGIN, Event.END
F = frozenset


CASES = [
    # (state, event, mode, flags, in_job) -> Transition
    (State.IDLE, B, V, F(), False, Transition(State.INITIAL_RUN, run=True, capture=True)),
    (State.IDLE, B, R, F(), False, Transition(State.INITIAL_RUN, run=True, capture=True)),
    (State.IDLE, B, D, F(), False, Transition(State.INITIAL_RUN, run=True, capture=False)),
    (State.INITIAL_RUN, E, V, F(), False, Transition(State.IDLE, run=False)),
    (
        State.INITIAL_RUN,
        E,
        V,
        F({Flag.REJECTED}),
        False,
        Transition(State.RERUN_IN_PLACE, run=True, replay=True),
    ),
    (State.INITIAL_RUN, E, D, F({Flag.REJECTED}), False, Transition(State.IDLE, run=False)),
    (State.INITIAL_RUN, E, R, F(), False, Transition(State.RERUN_IN_PLACE, run=True, replay=True)),
    (State.RERUN_IN_PLACE, E, R, F(), False, Transition(State.IDLE, run=False)),
    (
        State.RERUN_IN_PLACE,
        E,
        V,
        F({Flag.FATAL_REPRODUCED}),
        False,
        Transition(State.WILL_RERUN_ELSEWHERE, run=False, replay=True),
    ),
    (  # one rank transient, another reproducible: the reproducible one must be disambiguated
        State.RERUN_IN_PLACE,
        E,
        V,
        F({Flag.FATAL_REPRODUCED, Flag.FATAL_NOT_REPRODUCED}),
        False,
        Transition(State.WILL_RERUN_ELSEWHERE, run=False, replay=True),
    ),
    (
        State.RERUN_IN_PLACE,
        E,
        V,
        F({Flag.FATAL_NOT_REPRODUCED}),
        False,
        Transition(State.EXIT_FAILED, run=False, verdict=Diagnostic.TRANSIENT_ERROR),
    ),
    # non-fatal rejections only: continue with the re-run's result
    (State.RERUN_IN_PLACE, E, V, F(), False, Transition(State.IDLE, run=False)),
    (
        State.WILL_RERUN_ELSEWHERE,
        B,
        V,
        F(),
        False,
        Transition(State.RERUN_ELSEWHERE, run=True, replay=True),
    ),
    (State.WILL_RERUN_ELSEWHERE, B, D, F(), False, Transition(State.INITIAL_RUN, run=True)),
    (
        State.WILL_RERUN_ELSEWHERE,
        B,
        R,
        F(),
        False,
        Transition(State.INITIAL_RUN, run=True, capture=True),
    ),
    (
        State.RERUN_ELSEWHERE,
        E,
        V,
        F({Flag.SAME_HARDWARE, Flag.DIFFERS_ELSEWHERE}),
        False,
        Transition(State.EXIT_RESUME_ELSEWHERE, run=False),
    ),
    (
        State.RERUN_ELSEWHERE,
        E,
        V,
        F({Flag.DIFFERS_ELSEWHERE}),
        False,
        Transition(State.EXIT_FAILED, run=False, verdict=Diagnostic.PERSISTENT_ERROR),
    ),
    (
        State.RERUN_ELSEWHERE,
        E,
        V,
        F({Flag.DIFFERS_ELSEWHERE}),
        True,
        Transition(State.IDLE, run=False, verdict=Diagnostic.PERSISTENT_ERROR),
    ),
    (
        State.RERUN_ELSEWHERE,
        E,
        V,
        F({Flag.SAME_ELSEWHERE}),
        False,
        Transition(State.EXIT_FAILED, run=False, verdict=Diagnostic.CORRECT_RESULT),
    ),
    (
        State.RERUN_ELSEWHERE,
        E,
        V,
        F({Flag.SAME_ELSEWHERE}),
        True,
        Transition(State.EXIT_FAILED, run=False, verdict=Diagnostic.CORRECT_RESULT),
    ),
    (State.RERUN_ELSEWHERE, E, V, F(), False, Transition(State.IDLE, run=False)),
]


@pytest.mark.parametrize(("state", "event", "mode", "flags", "in_job", "expected"), CASES)
def test_transition(
    state: State,
    event: Event,
    mode: RerunMode,
    flags: frozenset[Flag],
    in_job: bool,
    expected: Transition,
) -> None:
    assert transition(state, event, mode, flags, continue_on_persistent=in_job) == expected


def test_every_state_and_event_is_covered_or_rejected() -> None:
    covered = {(c[0], c[1]) for c in CASES}
    for state in State:
        for event in Event:
            if (state, event) in covered:
                continue
            with pytest.raises(InvalidTransition, match=state.value):
                transition(state, event, V)


def test_begin_after_an_exit_verdict_names_the_fix() -> None:
    with pytest.raises(InvalidTransition, match="should_checkpoint_and_exit"):
        transition(State.EXIT_FAILED, B, V)


@pytest.mark.parametrize(
    ("state", "decision"),
    [
        (State.IDLE, (False, False, 0)),
        (State.INITIAL_RUN, (False, False, 0)),
        (State.RERUN_IN_PLACE, (False, False, 0)),
        (State.RERUN_ELSEWHERE, (False, False, 0)),
        (State.WILL_RERUN_ELSEWHERE, (True, True, 16)),
        (State.EXIT_RESUME_ELSEWHERE, (False, True, 16)),
        (State.EXIT_FAILED, (False, True, 17)),
    ],
)
def test_exit_decision(state: State, decision: tuple[bool, bool, int]) -> None:
    assert exit_decision(state) == decision


def test_every_persisted_state_can_begin_a_step() -> None:
    # A checkpoint written in any state must be resumable from disk alone (Megatron #3884).
    for state in State:
        saved = persisted_state(state)
        assert saved in (State.IDLE, State.WILL_RERUN_ELSEWHERE)
        assert transition(saved, B, V).run
