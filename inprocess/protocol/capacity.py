"""A restart decision short of ranks waits for the respawned processes already on their way.

Faults cluster (a failing node loses its ranks one after the other): the second death may come
while the first one's replacement is still starting. Counting only the ranks ready at that
moment, the decision would shrink the job or stop it ("not enough healthy ranks"); the
launchers announce each respawn before it starts (``job_keys.announce_respawn``), so the
decision can tell that capacity is coming and wait for it, bounded by
``RestartConfig.respawn_wait_timeout``.
"""

from __future__ import annotations

import logging

from restartable.inprocess.clock import SYSTEM, Clock
from restartable.inprocess.protocol import job_keys
from restartable.inprocess.protocol.policy import Decision, DecisionInputs
from restartable.inprocess.protocol.store import Store

log = logging.getLogger(__name__)
# The run journal's channel (``inprocess.journal`` writes what reaches it): the protocol sits
# below the journal and does not import it.
_journal = logging.getLogger("restartable.journal")

_POLL_S = 0.02  # how often a waiting decider re-reads the store (a few reads per wait)


def may_wait(decision: Decision, *, target: int, pending: frozenset[int]) -> bool:
    """Whether ``decision`` (taken with the ranks ready now) is short of ``target`` active ranks
    while respawns are ``pending``: only then may waiting for them change it
    (``decide_waiting``); otherwise it stands as it is."""
    return _size(decision) < target and bool(pending)


def decide_waiting(
    store: Store, inputs: DecisionInputs, *, timeout: float, clock: Clock = SYSTEM
) -> Decision:
    """The decision of the restart barrier of ``inputs.iteration``, waiting for pending
    respawns (``inputs.decide``: the policy with the store's gone and joined ranks).

    Called by the one rank that decides (``restart_meeting.decide``, when ``may_wait``), while
    every other rank waits for the published decision (bounded by ``barrier_timeout``, which
    must exceed ``timeout``). Decides with what the store holds now;
    when that decision fills fewer than ``target`` active ranks (it shrinks the job or stops it)
    and the announced respawns not yet ready would make it fill more, re-reads the store every
    ``_POLL_S`` until they joined, died, or ``timeout`` seconds passed, and decides again with
    what is there then.
    Blocks at most ``timeout`` (+ one poll). Logs and journals what it waited for.
    """
    iteration, target, decide = inputs.iteration, inputs.target, inputs.decide
    start = clock.monotonic()
    waited: set[int] = set()
    while True:
        gone, ready, pending = (frozenset(s) for s in job_keys.respawn_state(store))
        decision = decide(gone, ready)
        if not may_wait(decision, target=target, pending=pending):
            break
        if _size(decide(gone, ready | pending)) <= _size(decision):
            break  # the respawns on their way would not change the outcome
        if clock.monotonic() - start >= timeout:
            break
        waited |= pending
        clock.sleep(_POLL_S)
    if waited:
        _log_wait(iteration, decision, waited, ready, pending, clock.monotonic() - start, timeout)
    return decision


def _size(decision: Decision) -> int:
    return 0 if decision.assignment is None else decision.assignment.world_size


def _log_wait(
    iteration: int,
    decision: Decision,
    waited: set[int],
    ready: frozenset[int],
    pending: frozenset[int],
    waited_s: float,
    timeout: float,
) -> None:
    joined = sorted(waited & ready)
    missing = sorted(waited - ready)
    outcome = (
        f"{_size(decision)} active rank(s)"
        if decision.stop is None
        else f"stop: {decision.stop.splitlines()[0]}"
    )
    log.info(
        "restart decision of iteration %d waited %.2f s for respawned identities %s "
        "(respawn_wait_timeout %.1f s): joined %s, still missing %s (%s); %s",
        iteration,
        waited_s,
        sorted(waited),
        timeout,
        joined or "none",
        missing or "none",
        "still starting" if pending else "gone or not started",
        outcome,
    )
    if _journal.handlers:  # a journal is open (or listened to) in this process
        fields = {
            "iteration": iteration,
            "waited_for": sorted(waited),
            "joined": joined,
            "missing": missing,
            "waited_s": waited_s,
            "timeout_s": timeout,
            "active": _size(decision),
            "stop": decision.stop,
        }
        _journal.debug("respawn_wait", extra={"journal": fields})
