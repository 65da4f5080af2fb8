"""The exceptions of ``rerun``: one base for misuse and bad input, and the exit carrier."""

from __future__ import annotations

from typing import Literal

RankAction = Literal["demote", "retire"]


class RerunError(Exception):
    """Base of every exception that ``rerun`` raises (bad input, misuse, in-job exits)."""


class RerunConfigError(RerunError, ValueError):
    """A constructor or call argument is invalid; the message names field, value, rule and fix."""


class InvalidTransition(RerunError):
    """The training loop called the machine in an order the state machine does not allow."""


class RerunExit(RerunError):
    """Raised by ``RerunStateMachine.exit_or_raise()`` with ``in_job=True`` (``@restartable``).

    An ``Exception``, not a ``SystemExit``: the ``@restartable`` wrapper treats an ``Exception``
    from ``train()`` as a restartable fault of the raising rank and reads only
    ``restartable_rank_action`` from it, whereas a ``SystemExit`` means "this rank leaves the
    job". A verdict that a restart can act on is therefore an ``Exception``:

    * ``"demote"``: move this rank to the reserve pool; a warm reserve re-runs its work (code 16);
    * ``"retire"``: this rank's hardware is persistently faulty; remove the rank;
    * ``None``: no action on this rank. On the rank whose result did not reproduce (transient,
      code 17) it is an ordinary fault: restart from the last checkpoint. On the other ranks it
      is raised only after the suspect rank's restart has torn the group down, so the wrapper
      sees them as taking part in that restart, not as faulty.

    Verdicts that a restart cannot fix (a correct result: the model or the data produced it) and
    every verdict without ``in_job`` end the process with ``sys.exit(code)`` instead (16 or 17,
    Megatron's contract for schedulers). Do not swallow it in an ``except Exception`` around the
    step.
    """

    def __init__(
        self,
        exit_code: int,
        *,
        verdict: str | None,
        suspect_ranks: tuple[int, ...],
        suspect_hardware: tuple[str, ...],
        restartable_rank_action: RankAction | None,
        message: str,
    ) -> None:
        super().__init__(
            f"{message} (verdict={verdict}, suspect ranks={list(suspect_ranks)}, rank "
            f"action={restartable_rank_action}, exit status {exit_code})"
        )
        self.exit_code = exit_code
        self.verdict = verdict
        self.suspect_ranks = suspect_ranks
        self.suspect_hardware = suspect_hardware
        self.restartable_rank_action = restartable_rank_action
        self.message = message
