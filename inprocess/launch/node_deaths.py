"""Which of a node's ranks the relay counts as dead at a restart (``NodeRelay``'s
``dead_local``): a child the launcher saw exit, once its watchdog's death report is on the job
store, or ``REPORT_GRACE_S`` after the relay first saw it gone without one.

Why wait for the report: the launcher sees its child exit within one tick, usually before the
rank's watchdog has appended its fault record. Counted at once, the dead rank could complete its
node's count, the count complete the job's, and the decision be taken without the record: the
restart then blames only the collateral faults of its peers (the downtime report says "collateral,
not counted", found by tests/dist/test_launcher_recovery.py on the node path), while the per-rank
path counts a death only through that report. A death report appends the fault record and the
rank to the job's ``gone`` list in one batch, the record first (``fault_records.record_fault``;
a reserve's report appends to ``gone`` alone), so the rank in ``gone`` means its record is
there. Not the per-rank count ``restart/n/<rank>``: on the node path nobody counts ranks on the
job store (``keys.BY_NODE``), and waiting for that key made every death wait out the grace. A
watchdog that died with its rank never reports: after the grace the rank is counted anyway (the
decision then names it as the launcher's ``mark_gone`` did on the per-rank path).
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from restartable.inprocess.clock import SYSTEM, Clock
from restartable.inprocess.protocol.keys import gone_ranks
from restartable.inprocess.protocol.store import Store

REPORT_GRACE_S = 5.0  # the longest the relay waits for a dead rank's watchdog to report it


class ReportedDeaths:
    """``exited()``: the node's initial ranks whose process exited (the supervisor's). Called
    from the relay's thread only, with ``job`` its own job-store client."""

    def __init__(
        self, job: Store, exited: Callable[[], Collection[int]], *, clock: Clock = SYSTEM
    ) -> None:
        self._job, self._exited, self._clock = job, exited, clock
        self._reported: set[int] = set()  # ranks seen in ``gone`` (job-wide: never back)
        self._first_seen: dict[int, float] = {}  # rank -> when the relay first saw it exited

    def __call__(self) -> list[int]:
        """The exited ranks to count as dead now (one job-store read of ``gone`` when an exited
        rank's report is not seen yet and its grace is not over; none otherwise)."""
        now = self._clock.monotonic()
        dead, waiting = [], []
        for r in self._exited():
            first = self._first_seen.setdefault(r, now)
            if r in self._reported or now - first >= REPORT_GRACE_S:
                dead.append(r)
            else:
                waiting.append(r)
        if waiting:
            gone = gone_ranks(self._job)
            self._reported.update(r for r in waiting if r in gone)
            dead += [r for r in waiting if r in gone]
        return dead
