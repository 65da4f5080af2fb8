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
import socket
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

import torch

from rerun import agree, exits, persist, verdicts
from rerun.checks import (
    Rejection,
    Value,
    compare_floats,
    is_not_finite,
)
from rerun.data import RerunDataIterator
from rerun.errors import InvalidTransition, RerunConfigError, RerunExit
from rerun.injector import RerunErrorInjector
from rerun.passes import PassChecks
from rerun.replay import StepReplay
from rerun.report import report_verdict
from rerun.state_machine import (
    Diagnostic,
    Event,
    Flag,
    RerunMode,
    State,
    exit_decision,
    transition,
)

logger = logging.getLogger(__name__)

NAN_LOSS_MESSAGE = "loss is NaN or Inf"
SPIKY_LOSS_MESSAGE = "Spiky loss"
REPORT_INTERVAL_ITERATIONS = 100  # determinism stats are logged every this many steps

_BETWEEN_STEPS = (State.IDLE, State.WILL_RERUN_ELSEWHERE)

Data = RerunDataIterator | list[RerunDataIterator | None] | None


def _default_hardware_id() -> str:
    dev = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_initialized() else "cpu"
    return f"{socket.gethostname()}:{dev}"


class RerunStateMachine:
    """Validates results, re-runs a step with a rejected result, attributes the fault.

    Verdicts: a result that does not reproduce in place is a transient fault (exit 17, no
    checkpoint: resume from an earlier one); one that reproduces is re-run on other hardware
    (checkpoint, exit 16); there, a different result means a persistent fault of the first
    hardware and the same result a correct result / application problem (exit 17). Non-fatal
    checks (spiky loss) only log and continue with the re-run's result.

    Arguments (all but ``mode`` keyword-only):

    * ``mode``: ``disabled``, ``validate_results`` or ``report_determinism_stats``.
    * ``check_for_nan_in_loss`` / ``check_for_spiky_loss``: what ``validate_loss`` checks;
      ``spiky_loss_factor`` (> 1) x the running max of the first ``spiky_loss_warmup`` (and
      later non-spiky) losses is spiky.
    * ``error_injector``: a ``RerunErrorInjector`` for drills and tests.
    * ``result_rejected_tracker_filename``: JSON-lines file of rejections (see
      ``iterations_to_skip``); checked for writability here.
    * ``hardware_id``: what "other hardware" compares (default ``hostname:cuda:N`` / ``:cpu``).
    * ``in_job=True`` (under ``@restartable`` with warm reserves): after a persistent-fault
      verdict the step's work already runs on healthy hardware, so training continues; the
      faulty hardware is remembered (also in ``state_dict``) and a rank that later starts a step
      on it raises ``RerunExit`` with ``restartable_rank_action="retire"``.
    * ``state_save_func`` / ``state_restore_func``: extra RNG-like state to snapshot with the
      step (e.g. a tensor-parallel CUDA RNG tracker); the saved value must be picklable.
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
        self.mode = _checked_mode(mode, spiky_loss_factor, spiky_loss_warmup)
        self.check_for_nan_in_loss = check_for_nan_in_loss
        self.check_for_spiky_loss = check_for_spiky_loss
        self.spiky_loss_factor = float(spiky_loss_factor)
        self.spiky_loss_warmup = spiky_loss_warmup
        self.in_job = in_job
        self._injector = error_injector
        self._hardware_id = hardware_id
        self._replay = StepReplay(save_func=state_save_func, restore_func=state_restore_func)
        self._checks = PassChecks(
            self.mode,
            injector=error_injector,
            tracker_path=result_rejected_tracker_filename,
            rank=self._rank,
            hardware_id=lambda: self.hardware_id,
        )

        self.iteration = 0  # steps started; travels in state_dict
        self.verdict: Diagnostic | None = None  # the latest verdict
        self._state = State.IDLE
        self._faulty_hardware: list[str] = []
        self._suspects = verdicts.Suspects()
        self._rec = self._checks.rec  # the step's record (the checks fill it in)

    # -- properties -----------------------------------------------------------------------

    @property
    def state(self) -> State:
        return self._state

    @property
    def hardware_id(self) -> str:
        """Where this rank runs (host and device), to tell "other hardware" after a restart."""
        return self._hardware_id or _default_hardware_id()

    @property
    def faulty_hardware(self) -> list[str]:
        return list(self._faulty_hardware)

    # -- the loop -------------------------------------------------------------------------

    def should_run_forward_backward(self, data: Data = None) -> bool:
        """The ``while`` condition around forward/backward: True while the step must (re)run.

        Every rank must call it the same number of times (it may run one collective per pass).
        May raise ``RerunExit(retire)`` with ``in_job`` on hardware known to be faulty.
        """
        if self._state in (State.IDLE, State.WILL_RERUN_ELSEWHERE):
            self._replay.begin(
                data, required=self.mode is not RerunMode.DISABLED, mode=self.mode.value
            )
            if self.in_job and self.hardware_id in self._faulty_hardware:
                raise exits.retired(self.hardware_id, self._suspects, iteration=self.iteration)
            event, flags = Event.BEGIN, frozenset[Flag]()
        else:
            event, flags = Event.END, self._checks.end_pass(self._state, iteration=self.iteration)
        old = self._state
        t = transition(old, event, self.mode, flags, continue_on_persistent=self.in_job)
        self._state = t.state
        if event is Event.BEGIN and old is State.IDLE:
            self.iteration += 1
            self._rec.new_step()
            self._replay.new_step()
        if t.capture:
            self._replay.capture()
        if event is Event.BEGIN and old is State.IDLE:
            self._replay.advance(record=t.capture)
        if t.replay:
            self._replay.replay()
        if t.verdict is not None:
            self._on_verdict(t.verdict)
        if t.state in (State.WILL_RERUN_ELSEWHERE, State.EXIT_RESUME_ELSEWHERE):
            self._suspects = verdicts.suspects_after(self._rec, self._state)
        if t.run:
            self._rec.new_pass()
        return t.run

    def validate_loss(self, loss: Value) -> None:
        """The built-in loss checks: NaN/Inf (fatal) and, if enabled, spiky loss (non-fatal).

        A CUDA loss stays on the device (no sync until the end of the pass); a CPU loss is read
        once as a float, since reading it costs no synchronisation and float checks are cheaper
        than a dozen small tensor operations.
        """
        if self.mode is RerunMode.DISABLED:
            return
        if isinstance(loss, torch.Tensor) and loss.device.type == "cpu" and loss.numel() == 1:
            loss = float(loss.detach().item())
        if self.check_for_nan_in_loss:
            self.validate_result(loss, is_not_finite, NAN_LOSS_MESSAGE, tolerance=0.0, fatal=True)
        if self.check_for_spiky_loss:
            self.validate_result(loss, self._spiky, SPIKY_LOSS_MESSAGE, tolerance=0.0, fatal=False)

    def _spiky(self, value: Value) -> Rejection:
        return self.is_unexpectedly_large(
            value, self.spiky_loss_factor, "loss", num_samples=self.spiky_loss_warmup
        )

    def is_unexpectedly_large(
        self, value: Value, threshold: float, context: str, num_samples: int = 100
    ) -> Rejection:
        """A rejection function: ``|value| >= threshold x`` the running max of ``context``.

        The first ``num_samples`` values of a context only build the max. NaN/Inf are ignored
        (the NaN check owns them). No host sync for a tensor value.
        """
        return self._checks.large.check(value, threshold, context, num_samples)

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
        if self.mode is RerunMode.DISABLED or self._state in _BETWEEN_STEPS:
            return
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
        if self.mode is RerunMode.REPORT_DETERMINISM_STATS and (
            self.iteration % REPORT_INTERVAL_ITERATIONS == 0
        ):
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
        logger.info("rank %d: %s; %s", self._rank(), exc, then)
        exits.leave(
            exc,
            standalone=standalone,
            suspect=self._rank() in self._suspects.ranks,
            close=close,
            close_timeout=close_timeout,
        )

    def exit_exception(self) -> RerunExit:
        """The ``RerunExit`` describing the current exit decision (not raised)."""
        return exits.decided(
            self._state,
            self.verdict,
            rank=self._rank(),
            hardware_id=self.hardware_id,
            suspects=self._suspects,
            iteration=self.iteration,
        )

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
            faulty_hardware=self._faulty_hardware,
            large_values=self._checks.large.state(),
            injector=self._injector.state() if self._injector else {},
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
        self._faulty_hardware = p.faulty_hardware
        self._checks.large.load(p.large_values)
        if self._injector is not None:
            self._injector.load(p.injector)
        if p.state is not State.WILL_RERUN_ELSEWHERE:
            return
        if not persist.resumable(p, mode=self.mode, iteration=self.iteration):
            return
        self._state = State.WILL_RERUN_ELSEWHERE
        self._replay.load(p.rng, p.data)
        self._rec.rejected = p.rejected
        self._rec.suspect_hw = p.suspect_hw

    # -- internals ------------------------------------------------------------------------

    @staticmethod
    def _rank() -> int:
        return agree.rank_and_world()[0]

    def _on_verdict(self, verdict: Diagnostic) -> None:
        self.verdict = verdict
        self._suspects = verdicts.suspects_after(self._rec, self._state)
        if verdict is Diagnostic.PERSISTENT_ERROR:
            self._faulty_hardware += [
                h for h in self._suspects.hardware if h not in self._faulty_hardware
            ]
        report_verdict(self.iteration, verdict, self._suspects)


def _checked_mode(
    mode: str | RerunMode, spiky_loss_factor: float, spiky_loss_warmup: int
) -> RerunMode:
    """``mode`` as a ``RerunMode``, once the constructor's arguments passed their checks."""
    modes = [m.value for m in RerunMode]
    value = mode.value if isinstance(mode, RerunMode) else mode
    if value not in modes:
        raise RerunConfigError(f"mode ({mode!r}) must be one of {modes}: pick one of those")
    if not (isinstance(spiky_loss_factor, (int, float)) and spiky_loss_factor > 1.0):
        raise RerunConfigError(
            f"spiky_loss_factor ({spiky_loss_factor!r}) must be a number greater than 1 "
            "(a loss is spiky when larger than factor x the running max): use e.g. 10.0"
        )
    if spiky_loss_warmup < 1:
        raise RerunConfigError(
            f"spiky_loss_warmup ({spiky_loss_warmup}) must be >= 1 (losses recorded before "
            "spikes are flagged): use e.g. 100"
        )
    return RerunMode(value)
