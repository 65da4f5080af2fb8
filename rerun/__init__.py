"""Re-run state machine: validate results, re-run a step, attribute NaN and spiky loss."""

from restartable.rerun.checks import compare_floats, is_not_finite
from restartable.rerun.data import RerunDataIterator
from restartable.rerun.errors import InvalidTransition, RerunConfigError, RerunError, RerunExit
from restartable.rerun.injector import RerunErrorInjector
from restartable.rerun.machine import RerunStateMachine
from restartable.rerun.state_machine import (
    EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
    EXIT_CODE_RESUME_TO_DISAMBIGUATE,
    Diagnostic,
    RerunMode,
    State,
)
from restartable.rerun.tracker import iterations_to_skip

if __name__ != "restartable.rerun":  # the source tree's folder, imported by its old name
    raise ImportError(
        f"{__name__!r} is restartable's rerun/ folder imported by its old name: "
        "import restartable.rerun instead (python -m restartable.launch for the launcher)"
    )

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
