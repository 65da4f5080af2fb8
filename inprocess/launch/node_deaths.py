"""Which of a node's ranks the relay counts as dead at a restart (``NodeRelay``'s
``dead_local``): a child the launcher saw exit, once its watchdog's death report is on the job
store, or ``REPORT_GRACE_S`` after the relay first saw it gone without one.

Why wait for the report: the launcher sees its child exit within one tick, usually before the
rank's watchdog has appended its fault record. Counted at once, the dead rank could complete its
node's count, the count complete the job's, and the decision be taken without the record: the
restart then blames only the collateral faults of its peers (the downtime report says "collateral,
not counted", found by tests/dist/test_launcher_recovery.py on the node path), while the per-rank
path counts a death only through that report. A report appends the record first and then counts
the rank (``fault_records.count_once``: the key ``restart/n/<rank>``, a reserve's report too), so
that key on the job store means the record is there. A watchdog that died with its rank never
reports: after the grace the rank is counted anyway (the decision then names it as the
launcher's ``mark_gone`` did on the per-rank path).
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from restartable.inprocess.clock import SYSTEM, Clock
from restartable.inprocess.protocol.keys import key
from restartable.inprocess.protocol.store import Store

REPORT_GRACE_S = 5.0  # the longest the relay waits for a dead rank's watchdog to report it


class ReportedDeaths:
    """``exited()``: the node's initial ranks whose process exited (the supervisor's). Called
    from the relay's thread only, with ``job`` its own job-store client; ``iteration`` is the
    iteration the relay serves (set by its loop before each ``serve``)."""

    def __init__(
        self, job: Store, exited: Callable[[], Collection[int]], *, clock: Clock = SYSTEM
    ) -> None:
        self._job, self._exited, self._clock = job, exited, clock
        self.iteration = 0
        self._reported: set[tuple[int, int]] = set()  # (iteration, rank) seen counted
        self._first_seen: dict[int, float] = {}  # rank -> when the relay first saw it exited

    def __call__(self) -> list[int]:
        """The exited ranks to count as dead now (one job-store ``check`` per exited rank
        whose report is not seen yet; none for the others)."""
        now, it = self._clock.monotonic(), self.iteration
        dead = []
        for r in self._exited():
            first = self._first_seen.setdefault(r, now)
            if (it, r) not in self._reported and now - first < REPORT_GRACE_S:
                if not self._job.check([key(it, f"restart/n/{r}")]):
                    continue
                self._reported.add((it, r))
            dead.append(r)
        return dead
