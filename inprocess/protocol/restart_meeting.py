"""The restart barrier's steps: after a fault, every live participant meets, one of them decides,
and every rank reads the same published decision.

This module holds the steps and the keys they use (``restart/*`` in ``keys``); the caller drives
them and takes the decision (``inprocess.restart.agreement.restart_barrier``), in this order::

    meeting = RestartMeeting(store, iteration, initial_rank=me, participants=ranks)
    if meeting.arrive() or meeting.wait_decider(deadline=d, clock=clock):
        return meeting.publish(decide(...))          # this rank decides
    decision = meeting.wait_decision(deadline=d, clock=clock)
    # None: the decider is gone, this rank decides in its place (publish as above)

Exactly one rank decides: the live rank whose arrival completed the count, or, when a death
report completed it (the dying rank came last), the first live rank to claim
``restart/decider``. Everyone waits for the count's completion (``restart/full``), then the
others block on ``go``, the decision; the first decision published wins (compare-and-set), so all
ranks continue with the same one even if more faults are recorded later. Per rank: two ``add``
and two waits for a value, whatever the number of ranks; no value that lists every rank is read
except the decision (run-length encoded).

Rare cases, handled by the re-check every ``barriers.RECHECK_S`` of a waiter (so they cost up to
that much more): the decider died before publishing (reported gone: a waiter decides in its
place); a participant whose death was reported for an earlier iteration (it died during the
previous restart) is counted by a waiter.
"""

from __future__ import annotations

from collections.abc import Collection

from inprocess.clock import Clock
from inprocess.protocol.barriers import wait_released
from inprocess.protocol.keys import gone_ranks, key, peek
from inprocess.protocol.store import Store

# ``restart/full``'s value when a death report, not a live rank, completed the restart barrier.
REPORT_COMPLETED = "report"


def set_participants(store: Store, iteration: int, count: int) -> None:
    """How many ranks (active + reserve) take part in ``iteration``; every rank writes it."""
    store.set(*participants_item(iteration, count))


def participants_item(iteration: int, count: int) -> tuple[str, str]:
    """The key and value ``set_participants`` writes (for one ``set_many`` with others)."""
    return key(iteration, "restart/expected"), str(count)


def count_once(
    store: Store,
    iteration: int,
    initial_rank: int,
    *,
    expected: int | None = None,
    by: str = REPORT_COMPLETED,
) -> bool:
    """Count ``initial_rank`` at the restart barrier of ``iteration`` (once, alive or gone);
    True when this call completed the barrier.

    A live rank counts itself when it arrives (``by``: its own rank, ``expected``: the number of
    participants, which it knows); a rank reported gone is counted by the report (its watchdog
    arrives on its behalf; ``expected`` is read from the store, None before
    ``set_participants``), so the last of either completes the barrier at once. Whoever
    completes it writes ``restart/full`` = ``by`` (first writer wins): that rank decides.
    One ``count_arrival`` (two ``add`` calls on a TCPStore, one transaction on etcd), plus one
    read for a report. Never blocks.
    """
    n = store.count_arrival(key(iteration, "restart/n"), str(initial_rank))
    if expected is None:
        raw = peek(store, key(iteration, "restart/expected"))
        if raw is None:
            return False  # no live rank has started the iteration: one of them completes it
        expected = int(raw)
    if n < expected:
        return False
    return store.compare_set(key(iteration, "restart/full"), "", by).decode() == by


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

    def arrive(self) -> bool:
        """Count this rank; True when its arrival completed the count (it decides). Never
        blocks."""
        return count_once(
            self.store, self.iteration, int(self.me), expected=len(self.members), by=self.me
        )

    def wait_decider(self, *, deadline: float, clock: Clock) -> bool:
        """After ``arrive`` returned False: wait for the count's completion; True when this rank
        decides (it completed the count by counting a gone participant, or it claimed the
        decision a death report left to the live ranks). Raises ``StoreTimeoutError`` at
        ``deadline`` (``clock.monotonic()``)."""
        # First the count's completion, not the decision: when a death report completed it
        # (the killed rank's report came last, as after most SIGKILLs) no live rank did, and a
        # waiter must decide now, not at its next re-check (measured: one restart in three took
        # 1 s more by benchmarks/restart_latency.py --quick). One more wait per rank, whatever
        # the number.
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
        """``restart/full`` is set (waited for): its rank, or the first claimant, decides. True
        when that is this rank, or when the decider is gone (this rank decides in its place)."""
        store, me = self.store, self.me
        who = store.get(self.full).decode()
        if who == REPORT_COMPLETED:
            who = store.compare_set(self.claim, "", me).decode()
        return who == me or (who.isdigit() and int(who) in gone_ranks(store))
