"""Re-run state machine: validate results, re-run a step, attribute NaN and spiky loss."""

from rerun.checks import compare_floats, is_not_finite
from rerun.data import RerunDataIterator
from rerun.errors import InvalidTransition, RerunConfigError, RerunError, RerunExit
from rerun.injector import RerunErrorInjector
from rerun.machine import RerunStateMachine
from rerun.state_machine import (
    EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
    EXIT_CODE_RESUME_TO_DISAMBIGUATE,
    Diagnostic,
    RerunMode,
    State,
)
from rerun.tracker import iterations_to_skip

__all__ = [
    "EXIT_CODE_FAILED_ON_RESULT_VALIDATION",
    "EXIT_CODE_RESUME_TO_DISAMBIGUATE",
    "Diagnostic",
    "InvalidTransition",
    "RerunConfigError",
    "RerunDataIterator",
    "RerunError",
    "RerunErrorInjector",
    "RerunExit",
    "RerunMode",
    "RerunStateMachine",
    "State",
    "compare_floats",
    "is_not_finite",
    "iterations_to_skip",
]
