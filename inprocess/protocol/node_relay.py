"""The restart barrier by node, the relay's side: one process per node (the launcher) speaks to
the job's store for the node's ranks, which wait on the node's own store (``node_barrier``).

Per iteration ``n``, ``NodeRelay.serve(n)`` on the relay, in this order; its JOB-store calls:

1. one blocking ``get`` of ``it{n}/end``, re-armed every slice (the job client's timeout) while
   the iteration runs; the outcome is copied to the local store, where the monitors wait.
   "done": the end. "fault":
2. the local barrier: every member arrived (``node_barrier.count_local``) or is known dead
   (``sources.dead_local``: the launcher sees its child exit; the rank's watchdog still records
   the fault itself) -- local calls only. Then one ``count_arrival`` on ``restart/nodes/n``
   counts the node (a TCPStore ``add``; on etcd one transaction, where an ``add`` is a
   compare-and-swap that concurrent relays would retry quadratically). The arrival that
   completes the count (expected: ``node/nodes``) makes this node decide: ``restart/nodes/full``
   = this node, and the relay orders one of its live ranks to decide (``node/order/j`` =
   ``decide:<rank>``; that rank publishes ``restart/go``).
3. one blocking ``get`` of ``restart/go``; the decision is relayed (``go:<decision>``). The
   deciding node's relay makes no such call: its rank hands it the decision it published (or
   found published) on the node store (``node/decided``).

So 3 job-store calls per node per restart (the deciding node: ``restart/nodes/full`` instead of
the ``get``, plus its rank's reads and publish), whatever the number of ranks per node. Rare
cases, at the re-check after each slice of step 3 (``sources.gone_nodes``: nodes whose launcher
is gone): a gone node is counted once (``restart/nodes/gone/<k>`` claims it), and a gone
decider node is replaced by the first relay to claim ``restart/nodes/claim``. A relay that
counted its node and died before the count was full is counted again: the decision may then be
taken before the last node arrived, which reads the same ``restart/go`` when it does (a fault
it records late ends the next iteration).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from restartable.checkpoint.sealing import ForgedValueError
from restartable.inprocess.clock import SYSTEM, Clock
from restartable.inprocess.errors import StoreTimeoutError
from restartable.inprocess.protocol import node_barrier as nb
from restartable.inprocess.protocol.barriers import is_timeout, wait_value
from restartable.inprocess.protocol.keys import OUTCOME_FAULT, end_key, key, peek
from restartable.inprocess.protocol.store import Store

# How often the relay looks for members that died while it waits at the local barrier (a rank
# dead before it starts waiting is counted at once); each look is a few local calls.
LOCAL_RECHECK_S = 0.25
# How often a relay still waiting for the decision reads the job store's ``restart/nodes/full``
# when no node newly went (it finds an orphan count, rare): 2 job-store calls per relay each time,
# not each slice, so that a long restart of many nodes does not load the server per slice.
FULL_RECHECK_S = 5.0
# The slice of the deciding node's relay's wait for its own rank's decision (on the node
# store), after which it re-checks as after a job-store slice (its decider rank may be dead).
DECIDED_SLICE_S = 1.0
ORPHAN = "orphan"  # ``restart/nodes/full`` when the completing node has no live rank left
_COMPLETED, _TAKEOVER = "completed", "takeover"  # why a re-check makes this node decide


@dataclass(frozen=True)
class RelaySources:
    """What the relay's process knows of liveness: ``dead_local()`` the node's initial ranks
    whose process is gone; ``gone_nodes()`` the nodes whose relay is gone (a launcher's stale
    beat). Called at re-checks only."""

    dead_local: Callable[[], Collection[int]]
    gone_nodes: Callable[[], Collection[int]] = frozenset


@dataclass
class _Round:
    """The relay's state in one restart: which gone nodes it claimed, the orders it gave."""

    iteration: int
    expected: int
    claimed: set[int] = field(default_factory=set)
    orders: int = 0
    decider: int | None = None
    full_read_at: float = float("-inf")  # when ``_recheck`` last read ``restart/nodes/full``


class NodeRelay:
    """Node ``node``'s relay between the job's store ``job`` and the node's store ``local``.

    ``job`` is a client of its own whose timeout is the slice of a blocking ``get``: a slice
    that ends re-checks (and, while the iteration runs, ``stop``)."""

    def __init__(
        self, job: Store, local: Store, *, node: int, sources: RelaySources, clock: Clock = SYSTEM
    ) -> None:
        self.job, self.local, self.node, self.sources, self.clock = job, local, node, sources, clock

    def serve(
        self, iteration: int, *, timeout: float, stop: Callable[[], bool] = lambda: False
    ) -> str | None:
        """Relay iteration ``iteration``'s outcome and, after a fault, its restart decision;
        return the outcome, or None when ``stop()`` turned True first. The restart part is
        bounded by ``timeout`` seconds (``StoreTimeoutError``); the iteration itself is not."""
        outcome = self._outcome(iteration, stop)
        if outcome is None:
            return None
        self.local.set(end_key(iteration), outcome)
        if outcome == OUTCOME_FAULT:
            self._restart(iteration, deadline=self.clock.monotonic() + timeout)
        return outcome

    def _outcome(self, iteration: int, stop: Callable[[], bool]) -> str | None:
        while not stop():
            try:
                return self.job.get(end_key(iteration)).decode()
            except ForgedValueError:  # logged by the sealed store: a broken end is a fault
                return OUTCOME_FAULT
            except Exception as exc:
                if not is_timeout(exc):
                    raise
        return None

    def _restart(self, iteration: int, *, deadline: float) -> None:
        raw = self._local_barrier(iteration, deadline)
        expected = int(raw)
        rnd = _Round(iteration, expected)
        if self.job.count_arrival(key(iteration, "restart/nodes/n")) >= expected:
            self._decide_here(rnd)
        what = f"node {self.node}'s relay at restart barrier {iteration}"
        while True:
            if self.clock.monotonic() >= deadline:
                raise StoreTimeoutError(f"{what}: no decision within its timeout")
            try:
                decision = self._await_decision(rnd)
                break
            except Exception as exc:
                if not is_timeout(exc):
                    raise
            found = self._recheck(rnd)
            if found is not None:
                self._decide_here(rnd, takeover=found == _TAKEOVER)
        self._order(rnd, nb.ORDER_GO + decision)

    def _await_decision(self, rnd: _Round) -> str:
        """One slice of the wait for the decision. Where this node's rank decides, its publish's
        answer (the decision published first: its own or a takeover's) reaches the node store
        (``node/decided``): no job-store call; elsewhere one blocking ``get`` of ``restart/go``."""
        if rnd.decider is None:
            return self.job.get(nb.go_key(rnd.iteration)).decode()
        decided = nb.local_key(rnd.iteration, "decided")
        return wait_value(self.local, decided, DECIDED_SLICE_S).decode()

    def _local_barrier(self, iteration: int, deadline: float) -> str:
        """Wait until every member arrived or is dead (counting the dead); return the number of
        participating nodes (``node/nodes``)."""
        counted: set[int] = set()  # each dead member's bit is added once (node_barrier)
        full = nb.local_key(iteration, "full")
        members: tuple[int, ...] = ()
        while True:
            members = members or nb.node_members(self.local, iteration)
            for r in sorted((set(self.sources.dead_local()) & set(members)) - counted):
                counted.add(r)
                nb.count_local(self.local, iteration, members, r, alive=False, by="relay")
            left = deadline - self.clock.monotonic()
            if left <= 0:
                raise StoreTimeoutError(
                    f"node {self.node}'s local restart barrier {iteration}: members "
                    f"{sorted(members)} did not all arrive or die within its timeout"
                )
            try:
                wait_value(self.local, full, min(LOCAL_RECHECK_S, left))
                return self.local.get(nb.local_key(iteration, "nodes")).decode()
            except Exception as exc:
                if not is_timeout(exc):
                    raise

    def _decide_here(self, rnd: _Round, *, takeover: bool = False) -> None:
        """This node completed the count, or (``takeover``) replaces a gone decider: order a
        live rank to decide; with none left, mark the decision an orphan for the others."""
        live = self._live(rnd.iteration)
        full = key(rnd.iteration, "restart/nodes/full")
        if not live:
            rnd.decider = None  # no rank of this node decides: wait for restart/go
            self.job.set(full, ORPHAN)
            return
        me = str(self.node)
        if not takeover and self.job.compare_set(full, "", me).decode() != me:
            return  # a re-count completed it too: the first writer's node decides
        rnd.decider = min(live)
        self._order(rnd, f"{nb.ORDER_DECIDE}{rnd.decider}")

    def _live(self, iteration: int) -> set[int]:
        arrived = nb.arrived_alive(self.local, iteration, nb.node_members(self.local, iteration))
        return arrived - set(self.sources.dead_local())

    def _order(self, rnd: _Round, order: str) -> None:
        self.local.set(nb.local_key(rnd.iteration, f"order/{rnd.orders}"), order)
        rnd.orders += 1

    def _recheck(self, rnd: _Round) -> str | None:
        """After a slice without a decision: count gone nodes, replace a gone decider (this
        node's own dead decider rank, or a gone decider node). Not None: this node decides now
        (``_COMPLETED``: its count of a gone node completed the count; ``_TAKEOVER``). The job
        store's ``restart/nodes/full`` is read at once when a node newly went, else at most
        every ``FULL_RECHECK_S`` (an orphan count): every waiting relay reads it."""
        it, me = rnd.iteration, str(self.node)
        gone = set(self.sources.gone_nodes()) - {self.node}
        fresh = bool(gone - rnd.claimed)
        for k in sorted(gone - rnd.claimed):
            rnd.claimed.add(k)
            claim = key(it, f"restart/nodes/gone/{k}")
            if self.job.compare_set(claim, "", me).decode() != me:
                continue
            if self.job.count_arrival(key(it, "restart/nodes/n")) >= rnd.expected:
                return _COMPLETED
        if rnd.decider is not None:
            return _TAKEOVER if rnd.decider in set(self.sources.dead_local()) else None
        now = self.clock.monotonic()
        if not fresh and now - rnd.full_read_at < FULL_RECHECK_S:
            return None
        rnd.full_read_at = now
        raw = peek(self.job, key(it, "restart/nodes/full"))
        who = None if raw is None else raw.decode()
        if who == ORPHAN or (who is not None and who.isdigit() and int(who) in gone):
            if not self._live(it):  # it could not decide either: the claim is left to one that can
                return None
            claim = key(it, "restart/nodes/claim")
            return _TAKEOVER if self.job.compare_set(claim, "", me).decode() == me else None
        return None
