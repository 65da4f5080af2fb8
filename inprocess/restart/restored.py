"""Which tier each rank restored from after a restart, for the restart line and the report.

Every active rank of an iteration that follows a restart publishes, once its CheckpointManager
restore is done, the tier its own state came from (``publish``: one store write); the new rank
0 gathers them (``gather``: bounded, on a store client of its own, off the training thread)
so its line says e.g. "memory on 1 rank, node-local on 1 rank (the reserve)": rank 0's own
tier was only what rank 0 saw, and a rank that replaced a killed one cannot have restored from
memory. ``phrase`` is pure (the report uses it too).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Mapping

from restartable.inprocess.clock import SYSTEM, Clock
from restartable.inprocess.protocol import keys
from restartable.inprocess.protocol.store import Store

# How tiers are named to a user ("local_dir" and "peer" are the local tier's sources).
TIER_NAMES = {
    "memory": "memory",
    "local_dir": "node-local",
    "peer": "a peer's copy",
    "persistent": "persistent",
}
_POLL_S = 0.005


def tier_name(tier: str | None) -> str:
    """The user's name of a restore's tier ("nothing" when nothing was restored)."""
    return "nothing" if tier is None else TIER_NAMES.get(tier, tier)


def phrase(tiers: Mapping[int, str | None], newcomers: Collection[int]) -> str:
    """Ranks grouped by the tier they restored from, in rank order of first appearance, e.g.
    ``memory on 1 rank, node-local on 1 rank (the reserve)``. ``tiers``: initial rank -> tier
    (None: restored nothing); ``newcomers``: the initial ranks that were not active before the
    restart (reserves that took a place)."""
    groups: dict[str, list[int]] = {}
    for rank in sorted(tiers):
        groups.setdefault(tier_name(tiers[rank]), []).append(rank)
    parts = []
    for name, ranks in groups.items():
        text = f"{name} on {len(ranks)} rank{'s' if len(ranks) > 1 else ''}"
        new = [r for r in ranks if r in newcomers]
        if new and len(new) == len(ranks):
            text += " (the reserve)" if len(new) == 1 else " (reserves)"
        elif new:
            text += f" ({len(new)} of them {'reserves' if len(new) > 1 else 'a reserve'})"
        parts.append(text)
    return ", ".join(parts)


class TierBoard:
    """The store keys of one iteration's restored tiers, one per active rank.

    ``publish`` on the training thread (one write); ``gather`` on any thread with its own
    client (``open_client``), blocking at most ``timeout``.
    """

    def __init__(
        self,
        store: Store,
        open_client: Callable[[], Store],
        *,
        iteration: int,
        me: int,
        active: tuple[int, ...],
        timeout: float = 2.0,
        clock: Clock = SYSTEM,
    ) -> None:
        self._store, self._open = store, open_client
        self._iteration, self._me, self._active, self._timeout = iteration, me, active, timeout
        self._clock = clock

    def _key(self, rank: int) -> str:
        return f"{keys.iteration_prefix(self._iteration)}restored/{rank}"

    def publish(self, tier: str | None, step: int | None) -> None:
        """This rank restored ``step`` from ``tier`` (None, None: found nothing)."""
        self._store.set(self._key(self._me), json.dumps({"tier": tier, "step": step}))

    def gather(self) -> dict[int, str | None]:
        """Each active rank's tier, once all published or the timeout passed (the missing ones
        left out)."""
        client = self._open()
        names = [self._key(r) for r in self._active]
        deadline = self._clock.monotonic() + self._timeout
        while True:
            got = keys.peek_many(client, names)
            if all(g is not None for g in got) or self._clock.monotonic() > deadline:
                break
            self._clock.sleep(_POLL_S)
        close = getattr(client, "close", None)
        if close is not None:
            close()
        found = zip(self._active, got, strict=True)
        return {r: json.loads(g)["tier"] for r, g in found if g is not None}
