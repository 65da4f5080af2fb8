"""Rounds through the job's store: every rank's numbers in, one published answer out.

Never a collective on the training group: a report must not stall or break training, and a
rank that died must not hang the others. Keys, under the store the detector was given (under
``@restartable`` the iteration's ``ctx.store``, so no key of an earlier iteration is read)::

    straggler/{k}/plan       sync round k: the next plan, first writer wins
    straggler/{k}/r{rank}    report round k: that rank's numbers (JSON)
    straggler/{k}/report     report round k: the report every rank acts on, first writer wins

Every wait is bounded by ``timeout``; the published value, not each rank's own view, is what
every rank acts on, so all of them stop or demote at the same step.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import TYPE_CHECKING

from restartable.inprocess.clock import SYSTEM, Clock

if TYPE_CHECKING:
    import torch.distributed as dist

PREFIX = "straggler/"
# A blocked wait re-checks this often whether a peer already published the round's answer
# (a peer that timed out, or a late rank arriving after everyone else).
_RECHECK_S = 1.0


class StoreRounds:
    """The store side of the rounds of one detector on one rank.

    ``store``: a ``torch.distributed.Store`` (or anything with set/get/check/wait/compare_set).
    Call ``sync`` and ``report`` from the training thread, at the same round numbers on every
    rank. ``report`` blocks at most ``timeout`` seconds.
    """

    def __init__(
        self,
        store: dist.Store,
        *,
        rank: int,
        world_size: int,
        timeout: float,
        clock: Clock = SYSTEM,
    ) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.timeout, self.clock = timeout, clock

    def _key(self, k: int, name: str) -> str:
        return f"{PREFIX}{k}/{name}"

    def sync(self, k: int, proposal: str) -> str:
        """Sync round ``k``: propose ``proposal``; return the one every rank gets (no waiting)."""
        return _first_wins(self.store, self._key(k, "plan"), proposal)

    def report(
        self, k: int, mine: str, decide: Callable[[dict[int, str], tuple[int, ...]], str]
    ) -> str:
        """Report round ``k``: publish ``mine``, gather every rank's, return the published answer.

        Waits until every rank's numbers are in or ``timeout`` passed, then calls
        ``decide(numbers by rank, missing ranks)`` and publishes its answer unless a peer
        published first; returns the published answer. A rank that arrives after the answer
        was published returns it at once.
        """
        answer = self._key(k, "report")
        self.store.set(self._key(k, f"r{self.rank}"), mine)
        wanted = [self._key(k, f"r{r}") for r in range(self.world_size)]
        deadline = self.clock.monotonic() + self.timeout
        while True:
            if self.store.check([answer]):
                return _text(self.store.get(answer))
            left = deadline - self.clock.monotonic()
            if left <= 0:
                break
            try:
                self.store.wait(wanted, datetime.timedelta(seconds=min(left, _RECHECK_S)))
                break
            except Exception as exc:  # the store's timeout; anything else is fatal
                if not _is_timeout(exc):
                    raise
        present = {}
        missing = []
        for r, key in enumerate(wanted):
            if self.store.check([key]):
                present[r] = _text(self.store.get(key))
            else:
                missing.append(r)
        return _first_wins(self.store, answer, decide(present, tuple(missing)))


def _first_wins(store: dist.Store, key: str, value: str) -> str:
    return _text(store.compare_set(key, "", value))


def _text(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


def _is_timeout(exc: BaseException) -> bool:
    return isinstance(exc, TimeoutError) or "timeout" in str(exc).lower()
