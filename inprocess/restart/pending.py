"""A restart decided at the restart barrier but not yet logged, and the record it becomes.

Built by the restart loop (``inprocess.restart.loop``) right after the barrier's decision
(``PendingRestart.of``), and turned into the ``RestartRecord`` that the journal, the DEBUG
``restart {...}`` line and ``ctx.last_restart`` carry once the next iteration's group exists
(``record``: its ``reinit`` phase is measured by then). Pure: no I/O, never blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from restartable.inprocess.context import RestartRecord
from restartable.inprocess.protocol.policy import Decision
from restartable.inprocess.protocol.ranks import Assignment
from restartable.inprocess.restart.active import Outcome


@dataclass(frozen=True)
class PendingRestart:
    """A restart decided but not yet logged: logged once the next iteration's group exists."""

    decision: Decision
    before: Assignment
    after: Assignment
    phases: dict[str, float]  # detect, abort, unwind, barrier (seconds)
    fault_time: float = 0.0  # wall clock of the first fault (the console line's seconds)

    def record(self, *, reinit_s: float) -> RestartRecord:
        d = self.decision
        return RestartRecord(
            iteration=d.iteration + 1,
            cause=d.cause(),
            faulting_ranks=d.faulting_ranks,
            phases={**self.phases, "reinit": reinit_s},
            active_before=self.before.active,
            active_after=self.after.active,
            reserve_after=self.after.reserve,
        )

    @classmethod
    def of(
        cls, decision: Decision, *, before: Assignment, out: Outcome, barrier_s: float
    ) -> PendingRestart:
        """The restart ``decision`` (which has an assignment) took after the iteration that
        ended with ``out``; the restart barrier took ``barrier_s`` seconds."""
        assert decision.assignment is not None  # RestartAgreement.accept raised otherwise
        first = min((f.time for f in decision.faults if f.time), default=out.noticed)
        return cls(
            decision=decision,
            before=before,
            after=decision.assignment,
            phases={
                "detect": max(0.0, out.noticed - first),
                "abort": out.abort_s,
                "unwind": out.unwind_s,
                "barrier": barrier_s,
            },
            fault_time=first,
        )
