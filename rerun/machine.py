"""``RerunStateMachine``: drives the pure transitions from a training loop (RNG, data, agreement).

Call order per step, on every rank (the loop of ``README.md``)::

    while rsm.should_run_forward_backward(data):   # BEGIN, then END of each pass
        zero_grad(); loss = forward_backward(next(data))
        rsm.validate_loss(loss)                     # and/or rsm.validate_result(...)
    checkpoint, exit, code = rsm.should_checkpoint_and_exit()

Costs in ``validate_results`` mode without faults: one RNG snapshot (host only), one MAX
all-reduce of a one-element int32 tensor (the REJECTED flag; a re-run pass reduces all six flags)
on the default group (only when torch.distributed is initialised with more than one rank) and one
device-to-host read per step; the checks themselves stay on the device until that read.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

from restartable.rerun import agree, exits, persist
from restartable.rerun.checks import LargeValueTracker, Rejection, Value, compare_floats
from restartable.rerun.data import RerunDataIterator
from restartable.rerun.errors import InvalidTransition, RerunConfigError, RerunExit
from restartable.rerun.hardware import HardwareLedger
from restartable.rerun.injector import RerunErrorInjector
from restartable.rerun.loss_checks import LossChecks
from restartable.rerun.passes import PassChecks
from restartable.rerun.replay import StepReplay
from restartable.rerun.state_machine import (
    Diagnostic,
    Event,
    Flag,
    RerunMode,
    State,
    exit_decision,
    transition,
)

logger = logging.getLogger(__name__)

Data = RerunDataIterator | list[RerunDataIterator | None] | None


class RerunStateMachine:
    """Validates results, re-runs a step with a rejected result, attributes the fault.

    Verdicts: a result that does not reproduce in place is a transient fault (exit 17, no
    checkpoint: resume from an earlier one); one that reproduces is re-run on other hardware
    (checkpoint, exit 16); there, a different result means a persistent fault of the first
    hardware and the same result a correct result / application problem (exit 17). Non-fatal
    checks (spiky loss) only log and continue with the re-run's result.

    The arguments (all but ``mode`` keyword-only; tabled in docs/rerun.md) go to the units that
    use them: the four loss-check settings to ``rerun.loss_checks.LossChecks``, ``hardware_id``
    to ``rerun.hardware.HardwareLedger``, ``error_injector`` and
    ``result_rejected_tracker_filename`` (checked for writability here) to
    ``rerun.passes.PassChecks``, ``state_save_func`` / ``state_restore_func`` (extra RNG-like
    state to snapshot with the step, picklable) to ``rerun.replay.StepReplay``. With
    ``in_job=True`` (under ``@restartable`` with warm reserves) training continues after a
    persistent-fault verdict (the step's work already runs on healthy hardware), and a rank that
    later starts a step on the faulty hardware raises ``RerunExit(retire)``.
    """

    def __init__(
        self,
        mode: str | RerunMode = RerunMode.DISABLED,
        *,
        check_for_nan_in_loss: bool = True,
        check_for_spiky_loss: bool = False,
        spiky_loss_factor: float = 10.0,
        spiky_loss_warmup: int = 100,
        error_injector: RerunErrorInjector | None = None,
        result_rejected_tracker_filename: str | None = None,
        hardware_id: str | None = None,
        in_job: bool = False,
        state_save_func: Callable[[], Any] | None = None,
        state_restore_func: Callable[[Any], None] | None = None,
    ) -> None:
        self.mode = _checked_mode(mode)
        self._large = LargeValueTracker()  # is_unexpectedly_large's maxima, the spiky check's too
        self.loss_checks = LossChecks(
            check_for_nan_in_loss=check_for_nan_in_loss,
            check_for_spiky_loss=check_for_spiky_loss,
            spiky_loss_factor=spiky_loss_factor,
            spiky_loss_warmup=spiky_loss_warmup,
            large=self._large,
        )
        self.in_job = in_job
        self._hardware = HardwareLedger(hardware_id)
        self._replay = StepReplay(
            self.mode, save_func=state_save_func, restore_func=state_restore_func
        )
        self._checks = PassChecks(
            self.mode,
            injector=error_injector,
            tracker_path=result_rejected_tracker_filename,
            rank=_rank,
            hardware_id=lambda: self.hardware_id,
        )

        self.iteration = 0  # steps started; travels in state_dict
        self._state = State.IDLE
        self._rec = self._checks.rec  # the step's record (the checks fill it in)

    # -- properties -----------------------------------------------------------------------

    @property
    def state(self) -> State:
        return self._state

    @property
    def hardware_id(self) -> str:
        """Where this rank runs (host and device), to tell "other hardware" after a restart."""
        return self._hardware.id

    @property
    def faulty_hardware(self) -> list[str]:
        return list(self._hardware.faulty)

    @property
    def verdict(self) -> Diagnostic | None:
        """The latest verdict (None before the first)."""
        return self._hardware.verdict

    # -- the loop -------------------------------------------------------------------------

    def should_run_forward_backward(self, data: Data = None) -> bool:
        """The ``while`` condition around forward/backward: True while the step must (re)run.

        Every rank must call it the same number of times (it may run one collective per pass).
        May raise ``RerunExit(retire)`` with ``in_job`` on hardware known to be faulty.
        """
        if self._state in (State.IDLE, State.WILL_RERUN_ELSEWHERE):
            self._replay.begin(data)
            self._hardware.check(retire=self.in_job, iteration=self.iteration)
            event, flags = Event.BEGIN, frozenset[Flag]()
        else:
            event, flags = Event.END, self._checks.end_pass(self._state, iteration=self.iteration)
        old = self._state
        t = transition(old, event, self.mode, flags, continue_on_persistent=self.in_job)
        self._state = t.state
        if event is Event.BEGIN and old is State.IDLE:  # a new step (not a re-run's pass)
            self.iteration += 1
            self._rec.new_step()
            self._replay.start_step(capture=t.capture)
        elif t.capture:
            self._replay.capture()
        if t.replay:
            self._replay.replay()
        self._hardware.after(t, self._rec, iteration=self.iteration)
        if t.run:
            self._rec.new_pass()
        return t.run

    def validate_loss(self, loss: Value) -> None:
        """The built-in loss checks (``rerun.loss_checks``): NaN/Inf (fatal) and, if enabled,
        spiky loss (non-fatal), each through ``validate_result``."""
        if self.mode is not RerunMode.DISABLED:
            self.loss_checks.validate(loss, self.validate_result)

    def is_unexpectedly_large(
        self, value: Value, threshold: float, context: str, num_samples: int = 100
    ) -> Rejection:
        """A rejection function: ``|value| >= threshold x`` the running max of ``context``.

        The first ``num_samples`` values of a context only build the max. NaN/Inf are ignored
        (the NaN check owns them). No host sync for a tensor value.
        """
        return self._large.check(value, threshold, context, num_samples)

    def validate_result(
        self,
        value: Value,
        rejection_func: Callable[[Value], Rejection],
        message: str,
        *,
        tolerance: float = 0.0,
        fatal: bool = True,
        comparison_func: Callable[[float, float], float] = compare_floats,
    ) -> None:
        """Check ``value`` (a number or a one-element tensor) inside forward/backward.

        ``rejection_func(value)`` is truthy when the value is suspicious (a bool tensor is kept
        on its device until the end of the pass). On a re-run, the same call (same message, same
        position in the step) is compared with the first result: a relative difference above
        ``tolerance`` means "not reproducible". ``fatal=False`` only logs and continues.
        """
        self._checks.validate(
            value,
            rejection_func,
            message,
            tolerance=tolerance,
            fatal=fatal,
            comparison_func=comparison_func,
            state=self._state,
            iteration=self.iteration,
        )

    def should_checkpoint_and_exit(self) -> tuple[bool, bool, int]:
        """After the loop, before the optimizer step: ``(checkpoint, exit, exit_code)``.

        ``(True, True, 16)``: save a checkpoint now (this step, before the optimizer step, with
        ``state_dict()``), then exit or ``exit_or_raise()``. ``(False, True, 16|17)``: exit
        without saving. ``(False, False, 0)``: step the optimizer and go on.
        """
        self._checks.log_stats(self.iteration)
        return exit_decision(self._state)

    def exit_or_raise(self, *, close: Iterable[Any] = (), close_timeout: float = 120.0) -> NoReturn:
        """Act on an exit decision (call when ``should_checkpoint_and_exit`` says exit).

        Standalone (``in_job=False``) and for a correct result (a restart cannot fix the model or
        the data): closes every object of ``close`` (the ``CheckpointManager`` whose "checkpoint,
        then exit" save is in flight: its ``close()`` waits for the commit), each bounded by
        ``close_timeout`` seconds, then destroys the process groups and calls ``sys.exit(code)``
        on every rank (the distributed exit skips interpreter finalisation, so nothing it would
        have closed is closed).
        With ``in_job=True`` it raises ``RerunExit`` for ``@restartable``: at once on a rank
        with an action ("demote" / "retire") and on the rank whose result did not reproduce;
        the other ranks first wait until that rank's restart tears the default group down
        (bounded by the group's timeout), so that the wrapper sees them as taking part in the
        restart, not as faulty.
        """
        exc = self.exit_exception()
        standalone = not self.in_job or self.verdict is Diagnostic.CORRECT_RESULT
        # What happens next, not only the status: in a job the verdict is raised to the restart
        # and nothing exits (the line said "exit code 17" there).
        then = f"exiting with status {exc.exit_code}" if standalone else "raised to the restart"
        logger.info("rank %d: %s; %s", _rank(), exc, then)
        exits.leave(
            exc,
            standalone=standalone,
            suspect=_rank() in self._hardware.suspects.ranks,
            close=close,
            close_timeout=close_timeout,
        )

    def exit_exception(self) -> RerunExit:
        """The ``RerunExit`` describing the current exit decision (not raised)."""
        return self._hardware.exit_exception(self._state, rank=_rank(), iteration=self.iteration)

    def determinism_stats(self) -> dict[str, dict[str, Any]]:
        """Per message: count, identical, avg, p50, p90, p99, max of relative differences."""
        return {msg: st.summary() for msg, st in sorted(self._checks.stats.items())}

    # -- checkpoint -----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This rank's state; the same keys whatever the state (constant checkpoint structure).

        Per rank: store it under a rank-specific key or in per-rank storage. A pending re-run on
        other hardware carries the step's RNG snapshot and microbatches, so it resumes from disk
        alone. Call it between steps (e.g. when ``should_checkpoint_and_exit`` asks), not
        mid-pass.
        """
        return persist.capture(
            mode=self.mode.value,
            state=self._state,
            iteration=self.iteration,
            hardware_id=self.hardware_id,
            rec=self._rec,
            faulty_hardware=self._hardware.faulty,
            large_values=self._large.state(),
            injector=self._checks.injector.state() if self._checks.injector else {},
            replay=self._replay,
        )

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore from ``state_dict()``, before the job's first step.

        A pending re-run is restored only when the world size matches and the mode validates
        results; otherwise it is dropped with a warning, like a resharded job.
        """
        if self._state is not State.IDLE:
            raise InvalidTransition(
                f"load_state_dict() called in state {self._state.value}: load before the first "
                "should_run_forward_backward() of a job"
            )
        p = persist.decode(sd)
        self.iteration = p.iteration
        self._hardware.faulty = p.faulty_hardware
        self._large.load(p.large_values)
        if self._checks.injector is not None:
            self._checks.injector.load(p.injector)
        if persist.resumable(p, mode=self.mode, iteration=self.iteration):
            self._state = State.WILL_RERUN_ELSEWHERE
            self._replay.load(p.rng, p.data)
            self._rec.resume(p.rejected, p.suspect_hw)


def _rank() -> int:
    return agree.rank_and_world()[0]


def _checked_mode(mode: str | RerunMode) -> RerunMode:
    """``mode`` as a ``RerunMode``; ``RerunConfigError`` for an unknown one."""
    modes = [m.value for m in RerunMode]
    value = mode.value if isinstance(mode, RerunMode) else mode
    if value not in modes:
        raise RerunConfigError(f"mode ({mode!r}) must be one of {modes}: pick one of those")
    return RerunMode(value)
