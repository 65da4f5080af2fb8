"""The restart barrier and the decision every rank acts on, with the decisions' history.

Owned by the restart loop (``inprocess.restart.loop``), one per process; called on the main
thread: ``adopt`` once when a respawned process is admitted, then ``meet`` after every fault.
``meet`` blocks until the barrier is full or ``barrier_timeout`` passes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Sequence

from inprocess.clock import SYSTEM, Clock
from inprocess.config import RestartConfig
from inprocess.errors import FaultRecord, RestartAbortedError
from inprocess.protocol import capacity
from inprocess.protocol.fault_records import read_faults
from inprocess.protocol.policy import Decision, DecisionInputs
from inprocess.protocol.ranks import Assignment
from inprocess.protocol.restart_meeting import RestartMeeting
from inprocess.protocol.store import Store
from inprocess.restart.progress import ProgressTracker


def restart_barrier(
    store: Store,
    iteration: int,
    *,
    initial_rank: int,
    participants: Collection[int],
    decide: Callable[[list[FaultRecord]], str],
    timeout: float,
    clock: Clock = SYSTEM,
) -> str:
    """Every live participant meets after iteration ``iteration`` faulted; returns the decision.

    Called by every live participant (active and reserve) once its part of the iteration is
    over; blocks until the decision is published, at most ``timeout`` seconds
    (``StoreTimeoutError``). Drives the steps of ``inprocess.protocol.restart_meeting`` (which
    explains who decides); exactly one rank runs ``decide(faults)`` on the iteration's fault
    records and publishes its result, and every rank returns the decision published first.
    """
    meeting = RestartMeeting(store, iteration, initial_rank=initial_rank, participants=participants)
    deadline = clock.monotonic() + timeout
    if meeting.arrive() or meeting.wait_decider(deadline=deadline, clock=clock):
        return meeting.publish(decide(read_faults(store, iteration)))
    published = meeting.wait_decision(deadline=deadline, clock=clock)
    if published is None:  # the decider is gone before publishing: decide in its place
        return meeting.publish(decide(read_faults(store, iteration)))
    return published


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

    def meet(
        self,
        store: Store,
        progress: ProgressTracker,
        *,
        iteration: int,
        assignment: Assignment,
        target: int,
    ) -> Decision:
        """Every live rank meets; the first decision published is the one all ranks act on.

        Raises ``RestartAbortedError`` when that decision stops the job.
        """
        with progress.paused():
            raw = restart_barrier(
                store,
                iteration,
                initial_rank=self.me,
                participants=assignment.active + assignment.reserve,
                decide=functools.partial(self._decide, store, iteration, assignment, target),
                timeout=self.cfg.barrier_timeout,
                clock=self.clock,
            )
        decision = Decision.from_json(raw)
        self.adopt((decision,))
        if decision.stop is not None or decision.assignment is None:
            raise RestartAbortedError(
                decision.stop or "no assignment", self.history, origin=decision.stop_origin
            )
        return decision

    def _decide(
        self,
        store: Store,
        iteration: int,
        assignment: Assignment,
        target: int,
        faults: list[FaultRecord],
    ) -> str:
        """Gather the policy's inputs from the store and decide
        (``inprocess.protocol.policy.decide``).

        Any rank that finds the restart barrier full may run this; the store keeps the first
        decision published, so every rank acts on the same one. Every rank holds the same
        ``counted`` history (each appends the published decisions), so the inputs differ
        between ranks only in what the store held at the moment each read it.
        """

        inputs = DecisionInputs(
            iteration,
            tuple(faults),
            history=tuple(self.counted),
            assignment=assignment,
            target=target,
            node_of=self.node_of,
            config=self.cfg,
        )
        # Short of ranks, wait for the respawns the launchers announced (issue 35).
        return capacity.decide_waiting(
            store, inputs, timeout=self.cfg.effective_respawn_wait_timeout
        ).to_json()
