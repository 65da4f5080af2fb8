"""Who is suspect after a verdict, and what a raising rank asks of ``@restartable``."""

from __future__ import annotations

from dataclasses import dataclass

from restartable.rerun import agree
from restartable.rerun.errors import RankAction
from restartable.rerun.record import StepRecord
from restartable.rerun.state_machine import Diagnostic, State


@dataclass(frozen=True)
class Suspects:
    ranks: tuple[int, ...] = ()
    hardware: tuple[str, ...] = ()


def suspects_after(rec: StepRecord, state: State) -> Suspects:
    """``gather_suspects`` for the step of ``rec``, now in ``state``: this rank is suspect when
    it rejected a result that then failed elsewhere or did not reproduce (a collective)."""
    return gather_suspects(
        rec.rejected is not None and (bool(rec.suspect_hw) or state is State.EXIT_FAILED),
        rec.suspect_hw,
    )


def gather_suspects(is_suspect: bool, hardware: str) -> Suspects:
    """Every rank learns the suspect ranks and their hardware (a collective: fault path only)."""
    got = agree.gather_objects((agree.rank_and_world()[0], is_suspect, hardware))
    return Suspects(
        ranks=tuple(r for r, s, _h in got if s),
        hardware=tuple(h for _r, s, h in got if s and h),
    )


def rank_action(
    code: int, *, rank: int, hardware_id: str, verdict: Diagnostic | None, suspects: Suspects
) -> RankAction | None:
    """ "demote" the suspect rank of a code 16, "retire" a rank on persistently faulty hardware."""
    if code == 16 and rank in suspects.ranks:
        return "demote"
    if verdict is Diagnostic.PERSISTENT_ERROR and hardware_id in suspects.hardware:
        return "retire"
    return None


def exit_message(state: State, verdict: Diagnostic | None) -> str:
    if state is State.WILL_RERUN_ELSEWHERE:
        return (
            "result reproduced on this hardware: re-run the step on other hardware from the "
            "checkpoint just saved"
        )
    if state is State.EXIT_RESUME_ELSEWHERE:
        return "resumed on the suspect hardware: resume the same checkpoint on other hardware"
    return f"result validation failed ({verdict.value if verdict else 'no verdict'})"
