"""The exceptions of ``rerun``: one base for misuse and bad input, and the exit carrier."""

from __future__ import annotations

from typing import Literal

RankAction = Literal["demote", "retire"]


class RerunError(Exception):
    """Base of every error that ``rerun`` raises for bad input or misuse."""


class RerunConfigError(RerunError, ValueError):
    """A constructor or call argument is invalid; the message names field, value, rule and fix."""


class InvalidTransition(RerunError):
    """The training loop called the machine in an order the state machine does not allow."""


class RerunExit(SystemExit):
    """Raised by ``RerunStateMachine.exit_or_raise()`` when a verdict ends this run of ``train()``.

    It subclasses ``SystemExit`` (a ``BaseException``) on purpose:

    * standalone, nobody catches it and the process exits with ``exit_code`` exactly as
      ``sys.exit(exit_code)`` would (16: resume on other hardware, 17: failed validation), which is
      the contract schedulers already know from Megatron;
    * user code that guards its step with ``except Exception`` does not swallow it;
    * under ``@restartable`` the wrapper catches it around ``train()`` and reads only
      ``restartable_rank_action``: ``"demote"`` (move this rank to the reserve pool, a warm
      reserve re-runs its work), ``"retire"`` (this rank's hardware is persistently faulty, remove
      it) or ``None`` (this rank is healthy and takes part in the restart like any other).
      A wrapper that does not know the attribute lets it propagate, which degrades to the
      standalone behaviour (the job exits with the code), never to a silent continue.
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
        super().__init__(exit_code)
        self.exit_code = exit_code
        self.verdict = verdict
        self.suspect_ranks = suspect_ranks
        self.suspect_hardware = suspect_hardware
        self.restartable_rank_action = restartable_rank_action
        self.message = message

    def __str__(self) -> str:
        return (
            f"exit code {self.exit_code}: {self.message} (verdict={self.verdict}, "
            f"suspect ranks={list(self.suspect_ranks)}, "
            f"rank action={self.restartable_rank_action})"
        )
