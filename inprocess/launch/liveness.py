"""Which launchers are still there: each one reports the processes it still runs in the round
(``<ns>r{k}/live/{n}``) and beats (``<ns>beat/{n}``, a count), and marks itself left
(``<ns>left/{n}``) at the end. A reader times another launcher's beat with its own monotonic
clock: a launcher counts as gone when it left or its beat did not change for ``beat_stale``
seconds, never by comparing the wall clocks of two hosts (2 s of skew would have deleted a live
node's keys on etcd)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from restartable.inprocess.clock import Clock
from restartable.inprocess.launch.control_store import ControlStore
from restartable.inprocess.launch.launch_id import TOKEN_KEY
from restartable.inprocess.launch.node_lost import store_lost

log = logging.getLogger(__name__)

_POLL_S = 0.05  # how often a leaving launcher looks at the others


class Liveness:
    """This launcher's beat and its view of the others' (``JobControl`` owns one).

    ``report_live`` each supervision tick; ``job_gone`` by whoever waits for the job's end;
    ``mark_left`` once at the end, then one of the two waits its backend chooses
    (``wait_for_others`` on node 0 of the TCPStore, ``last_out`` on etcd), each bounded by
    ``node_timeout``."""

    def __init__(
        self,
        control: ControlStore,
        *,
        node_rank: int,
        nnodes: int,
        beat_stale: float,
        node_timeout: float,
        clock: Clock,
    ) -> None:
        self._control, self._node_rank, self._nnodes = control, node_rank, nnodes
        self._beat_stale, self._node_timeout, self._clock = beat_stale, node_timeout, clock
        self._beats = 0  # this launcher's beat count (report_live)
        # Another launcher's last beat (or stand-in) value and when (this clock's monotonic) it
        # changed, by (key name, node).
        self._seen: dict[tuple[str, int], tuple[bytes, float]] = {}

    def report_live(self, k: int, n: int) -> None:
        """Node's processes still running in round ``k`` (live or due for respawn); also this
        launcher's heartbeat. Raises ``NodeLostError`` when the control store is gone."""
        c = self._control
        try:
            c.store.set(c.key(f"r{k}/live/{self._node_rank}"), str(n))
            self._beats += 1
            c.store.set(c.key(f"beat/{self._node_rank}"), str(self._beats))
        except Exception as exc:
            raise store_lost(exc) from exc

    def job_gone(self, k: int) -> bool:
        """True when every node reported no process left in round ``k``."""
        c = self._control
        keys = [c.key(f"r{k}/live/{n}") for n in range(self._nnodes)]
        try:
            if not c.store.check(keys):
                return False
            return all(int(c.store.get(key)) == 0 for key in keys)
        except Exception as exc:
            raise store_lost(exc) from exc

    def gone_nodes(self) -> frozenset[int]:
        """The other nodes whose launcher left or whose beat is stale (``_still_there``)."""
        others = (n for n in range(self._nnodes) if n != self._node_rank)
        return frozenset(n for n in others if not self._still_there(n))

    def mark_left(self) -> None:
        """This launcher is leaving (the store's errors propagate)."""
        self._control.store.set(self._control.key(f"left/{self._node_rank}"), "1")

    def wait_for_others(self) -> None:
        """Block until every other launcher left or went stale, at most ``node_timeout``: node
        0's TCPStore must outlive every reader (the store's errors propagate)."""
        deadline = self._clock.monotonic() + self._node_timeout
        waiting = list(range(1, self._nnodes))
        while waiting and self._clock.monotonic() < deadline:
            waiting = [n for n in waiting if self._still_there(n, stand_in=True)]
            self._clock.sleep(_POLL_S)

    def last_out(self, clean: Callable[[], None]) -> None:
        """Call ``clean`` if this launcher is the last one out (every other one left, or its
        beat is stale), once among launchers leaving together; at most ``node_timeout``."""
        c = self._control
        deadline = self._clock.monotonic() + self._node_timeout
        others = [n for n in range(self._nnodes) if n != self._node_rank]
        cleanup = c.key("cleanup")
        while self._clock.monotonic() < deadline:
            # Another launcher cleans (or did: the token is gone with every other key).
            if c.store.check([cleanup]) or not c.store.check([TOKEN_KEY]):
                return
            others = [n for n in others if self._still_there(n, stand_in=True)]
            if not others:
                # Two launchers leaving at once may both see the other gone: one deletes.
                won = c.store.compare_set(cleanup, "", str(self._node_rank))
                if won.decode() == str(self._node_rank):
                    clean()
                return
            self._clock.sleep(_POLL_S)
        log.warning(
            "node(s) %s still running after --node-timeout (%s s): the job's keys on etcd are "
            "left for them to delete",
            others,
            self._node_timeout,
        )

    def _still_there(self, node: int, *, stand_in: bool = False) -> bool:
        """False once ``node``'s launcher left, or its beat stayed the same for ``beat_stale``
        seconds of this launcher's monotonic clock (from the first time this one read it).
        ``stand_in``: a killed launcher's stand-in (``inprocess.srun_task``, its own key
        ``standin/{n}``) counts as there too: the waits before this launcher leaves keep the
        store up for its read of the job's end. Never for ``gone_nodes``: a restart must count
        a node whose launcher was killed as gone (the stand-in wrote the launcher's beat until
        2 December 2026, and a restart waited for such a node until its timeout)."""
        c = self._control
        if c.store.check([c.key(f"left/{node}")]):
            return False
        return self._fresh("beat", node, absent=True) or (
            stand_in and self._fresh("standin", node, absent=False)
        )

    def _fresh(self, name: str, node: int, *, absent: bool) -> bool:
        """Whether ``node``'s key ``name`` changed within ``beat_stale`` (``absent``: the answer
        while the key does not exist; a beat not started yet counts as fresh, the deadline
        bounds that wait)."""
        c = self._control
        value = c.store.try_get(c.key(f"{name}/{node}"))
        if value is None:
            return absent
        now = self._clock.monotonic()
        seen = self._seen.get((name, node))
        if seen is None or seen[0] != value:
            self._seen[(name, node)] = (value, now)
            return True
        return now - seen[1] < self._beat_stale
