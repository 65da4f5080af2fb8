"""The restart barrier: after a fault, every live participant meets, one of them decides, and
every rank reads the same published decision.

``restart_barrier`` drives the steps (``RestartMeeting``, keys ``restart/*`` in ``keys``) in this
order, on the main thread of every live participant (the restart loop's restart phase)::

    meeting = RestartMeeting(store, iteration, initial_rank=me, participants=ranks)
    if meeting.arrive() or meeting.wait_decider(deadline=d, clock=clock):
        return meeting.publish(decide(faults))       # this rank decides
    decision = meeting.wait_decision(deadline=d, clock=clock)
    # None: the decider is gone, this rank decides in its place (publish as above)

``decide`` (the restart loop passes ``functools.partial(decide, store, inputs, ...)``) is the
policy (``policy.decide``) on what the store holds; only when the decision is short of ranks
and respawns are on their way does it wait for them (``capacity.decide_waiting``).

Exactly one rank decides: the live rank whose arrival completed the count, or, when a death
report completed it (the dying rank came last), the first live rank to claim
``restart/decider``. The last ``FULL_WATCHERS`` live arrivals wait for the count's completion
(``restart/full``) first, so a report that completes it is claimed at once; every other rank
blocks on ``go``, the decision, alone. The first decision published wins (compare-and-set), so
all ranks continue with the same one even if more faults are recorded later. Per rank: two
``add``, one wait and one get, whatever the number of ranks (a full watcher: one wait and get
more); no value that lists every rank is read except the decision (run-length encoded). A death
report counts its rank itself (``fault_records.count_once``), before the iteration ends.

Rare cases, handled by the re-check every ``barriers.RECHECK_S`` of a waiter (so they cost up to
that much more): the decider died before publishing (reported gone: a waiter decides in its
place); a participant whose death was reported for an earlier iteration (it died during the
previous restart) is counted by a waiter; more than ``FULL_WATCHERS`` deaths reported after
the last live rank arrived (a report completed the count and no full watcher saw it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection

from restartable.inprocess.clock import SYSTEM, Clock
from restartable.inprocess.errors import FaultRecord
from restartable.inprocess.protocol import capacity, job_keys
from restartable.inprocess.protocol.barriers import wait_released
from restartable.inprocess.protocol.fault_records import (
    REPORT_COMPLETED,
    count_live,
    count_once,
    read_faults,
)
from restartable.inprocess.protocol.keys import gone_ranks, key, participants_item, peek
from restartable.inprocess.protocol.policy import DecisionInputs
from restartable.inprocess.protocol.store import Store

# How many of the last live arrivals wait for the count's completion before the decision: a
# death reported after every live rank arrived (peers saw a broken collective first) completes
# the count, and no live rank did; a full watcher sees that at once and claims the decision.
# The others wait for the decision alone: two calls fewer per rank than every rank watching
# (docs/scale.md, issue 52). Up to this many deaths reported last are decided at once; more,
# at the first re-check (``barriers.RECHECK_S``).
FULL_WATCHERS = 8


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
    (``StoreTimeoutError``). Exactly one rank runs ``decide(faults)`` on the iteration's fault
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


def decide(
    store: Store,
    inputs: DecisionInputs,
    faults: list[FaultRecord],
    *,
    respawn_wait_timeout: float,
    clock: Clock = SYSTEM,
) -> str:
    """The decision on ``faults`` (JSON, for ``publish``): ``inputs`` with those records, the
    ranks the store says are gone and the respawned ones ready to join (``policy.decide``).

    Short of ranks while respawns announced by the launchers are on their way, the decision
    waits for them (``capacity.decide_waiting``, at most ``respawn_wait_timeout``; issue 35).
    Any rank that finds the restart barrier full may run this; the store keeps the first
    decision published, so every rank acts on the same one."""
    inputs = dataclasses.replace(inputs, faults=tuple(faults))
    gone, ready, pending = (frozenset(s) for s in job_keys.respawn_state(store))
    decision = inputs.decide(gone, ready)
    if capacity.may_wait(decision, target=inputs.target, pending=pending):
        decision = capacity.decide_waiting(store, inputs, timeout=respawn_wait_timeout, clock=clock)
    return decision.to_json()


def set_participants(store: Store, iteration: int, count: int) -> None:
    """How many ranks (active + reserve) take part in ``iteration``; every rank writes it."""
    store.set(*participants_item(iteration, count))


class RestartMeeting:
    """One live rank's part of the restart barrier of ``iteration`` (the state its re-checks
    share). ``participants``: the initial ranks of the iteration (their number was published
    with ``set_participants``). A rank reported gone (``fault_records.GONE_KINDS``) is counted
    by the report itself, so nobody waits for it, whichever comes first."""

    def __init__(
        self, store: Store, iteration: int, *, initial_rank: int, participants: Collection[int]
    ) -> None:
        self.store, self.iteration = store, iteration
        self.me, self.members = str(initial_rank), set(participants)
        self.full, self.go, self.claim = (
            key(iteration, f"restart/{k}") for k in ("full", "go", "decider")
        )
        self.what = f"restart barrier {iteration}"
        self.watches_full = True  # one of the last arrivals (set by ``arrive``)

    def arrive(self) -> bool:
        """Count this rank; True when its arrival completed the count (it decides). Never
        blocks."""
        decides, n = count_live(
            self.store, self.iteration, int(self.me), expected=len(self.members), by=self.me
        )
        self.watches_full = n >= len(self.members) - FULL_WATCHERS
        return decides

    def wait_decider(self, *, deadline: float, clock: Clock) -> bool:
        """After ``arrive`` returned False: wait for the count's completion; True when this rank
        decides (it completed the count by counting a gone participant, or it claimed the
        decision a death report left to the live ranks). Raises ``StoreTimeoutError`` at
        ``deadline`` (``clock.monotonic()``). False at once, with no call, for a rank that is
        not one of the last ``FULL_WATCHERS`` arrivals."""
        # First the count's completion, not the decision: when a death report completed it
        # (the killed rank's report came last, its peers having seen a broken collective first)
        # no live rank did, and a waiter must decide now, not at its next re-check (measured:
        # one restart in three took 1 s more by benchmarks/restart_latency.py --quick). Only the
        # last arrivals can see that: the others wait for the decision alone.
        if not self.watches_full:
            return False
        who = wait_released(
            self.store,
            self.full,
            deadline=deadline,
            clock=clock,
            what=self.what,
            recheck=self._count_gone,
        )
        if who is None:  # this rank's count of a gone participant completed it
            return True
        if who == REPORT_COMPLETED:
            who = self.store.compare_set(self.claim, "", self.me).decode()  # first claim decides
        return who == self.me

    def wait_decision(self, *, deadline: float, clock: Clock) -> str | None:
        """After ``wait_decider`` returned False: block until the decision is published and
        return it; None when the decider is gone before publishing (this rank decides in its
        place). Raises ``StoreTimeoutError`` at ``deadline``."""
        return wait_released(
            self.store,
            self.go,
            deadline=deadline,
            clock=clock,
            what=self.what,
            recheck=self._decider_gone,
        )

    def publish(self, decision: str) -> str:
        """Publish this rank's decision; return the one published first (every rank's)."""
        return self.store.compare_set(self.go, "", decision).decode()

    def _count_gone(self) -> bool:
        """Count the participants reported gone (for an earlier iteration); True when that
        completed the count (``restart/full`` is now this rank)."""
        for r in sorted(gone_ranks(self.store) & self.members):
            if count_once(self.store, self.iteration, r, expected=len(self.members), by=self.me):
                return True
        return False

    def _decider_gone(self) -> bool:
        """Once ``restart/full`` is set, its rank, or the first claimant, decides. True when that
        is this rank, or when the decider is gone (this rank decides in its place); before, as
        ``_count_gone`` (a rank that waits for the decision alone has not seen the count)."""
        store, me = self.store, self.me
        raw = peek(store, self.full)
        if raw is None:
            return self._count_gone()
        who = raw.decode()
        if who == REPORT_COMPLETED:
            who = store.compare_set(self.claim, "", me).decode()
        return who == me or (who.isdigit() and int(who) in gone_ranks(store))
