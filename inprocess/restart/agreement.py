"""This rank's copy of the job's restart decisions: the inputs of the next one, and the one
every rank acts on.

Owned by the restart loop (``inprocess.restart.loop``), one per process; called on the main
thread: ``adopt`` once when a respawned process is admitted; after every fault the loop takes
``decider`` to the restart barrier (``inprocess.protocol.restart_meeting.restart_barrier``) and
hands the decision published there to ``accept``. Nothing here blocks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from restartable.inprocess.clock import SYSTEM, Clock
from restartable.inprocess.config import RestartConfig
from restartable.inprocess.errors import FaultRecord, RestartAbortedError
from restartable.inprocess.protocol import restart_meeting
from restartable.inprocess.protocol.policy import Decision, DecisionInputs
from restartable.inprocess.protocol.ranks import Assignment
from restartable.inprocess.protocol.store import Store


class RestartAgreement:
    """This rank's copy of the job's decisions: every fault (``history``, for the stop error)
    and what each restart blamed (``counted``, the policy's input). Every rank appends the same
    published decisions, so every rank decides from the same history."""

    def __init__(
        self, cfg: RestartConfig, *, me: int, node_of: Sequence[int], clock: Clock = SYSTEM
    ) -> None:
        self.cfg, self.me, self.node_of, self.clock = cfg, me, node_of, clock
        self.history: list[FaultRecord] = []
        self.counted: list[tuple[FaultRecord, ...]] = []

    def adopt(self, decisions: Sequence[Decision]) -> None:
        """Take over the decisions taken before this process was admitted."""
        for d in decisions:
            self.history.extend(d.faults)
            self.counted.append(d.counted)

    def decider(
        self, store: Store, iteration: int, assignment: Assignment, target: int
    ) -> Callable[[list[FaultRecord]], str]:
        """The ``decide`` of ``iteration``'s restart barrier: ``restart_meeting.decide`` with
        this rank's inputs (the fault records are read at the barrier). Every rank holds the
        same ``counted`` history, so the inputs differ between ranks only in what the store
        held at the moment each read it."""
        inputs = DecisionInputs(
            iteration,
            (),
            history=tuple(self.counted),
            assignment=assignment,
            target=target,
            node_of=self.node_of,
            config=self.cfg,
        )
        return functools.partial(
            restart_meeting.decide,
            store,
            inputs,
            respawn_wait_timeout=self.cfg.effective_respawn_wait_timeout,
            clock=self.clock,
        )

    def accept(self, published: str) -> Decision:
        """The decision published at the restart barrier (every rank's), added to the history.

        Raises ``RestartAbortedError`` when that decision stops the job.
        """
        decision = Decision.from_json(published)
        self.adopt((decision,))
        if decision.stop is not None or decision.assignment is None:
            raise RestartAbortedError(
                decision.stop or "no assignment", self.history, origin=decision.stop_origin
            )
        return decision
