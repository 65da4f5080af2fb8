"""What the local tier holds in memory: its shards, its buffer pool, and which steps it keeps.

Shared by the training thread (LocalTier.save / load) and the tier's background thread
(checkpoint.local.background); every method takes the one lock, none blocks on anything else.

Retention. A step is *confirmed* once every rank reported it complete (own copy, node-local
file, replicas) through the store agreement, which runs once every `AGREE_EVERY` saves (see
checkpoint.local.background). Kept: the newest `keep` confirmed steps, and the steps saved since
the last agreement, of which only the newest two (the one in flight and the one before it)
survive the next save (one save's background work is in flight at a time, so the agreement
that could confirm them is over by then). So memory holds at most keep + 2 buffers of each
shard kind, as with a per-step agreement, while the store sees one agreement per
`AGREE_EVERY` saves.
"""

from __future__ import annotations

import threading

import torch

from restartable.checkpoint.local.restore import Shard

UNCONFIRMED_KEPT = 2  # newest unconfirmed steps kept: the one in flight and the one before


class Holdings:
    """Shards by (step, owner), the free buffers, the confirmed steps and the recent ones."""

    def __init__(self, keep: int) -> None:
        self._keep = keep
        self._lock = threading.Lock()
        self.held: dict[tuple[int, int], Shard] = {}
        self._free: list[torch.Tensor] = []
        self._confirmed: list[int] = []  # complete on every rank, oldest first (<= keep)
        self._recent: list[int] = []  # saved here since the last agreement, oldest first
        self._ok: set[int] = set()  # recent steps whose background work succeeded here

    # ------------------------------------------------------------- training thread

    def take(self, nbytes: int, pinned: bool = False) -> torch.Tensor:
        """A reused buffer of at least nbytes, else a new pre-faulted one (first saves only).

        pinned: page-locked, so device-to-host copies of GPU state run at full speed. Also called
        by the background thread for received replicas.
        """
        with self._lock:
            fits = [b for b in self._free if b.numel() >= nbytes and b.is_pinned() >= pinned]
            if fits:
                best = min(fits, key=lambda b: b.numel())
                self._free = [b for b in self._free if b is not best]
                return best
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        buf.zero_()  # fault the pages in now, not during the copy of a later save
        return buf

    def stale(self, step: int, world: int) -> bool:
        """Whether `forget_stale(step, world)` would free anything (cheap)."""
        with self._lock:
            if any(s >= step for s in (*self._confirmed, *self._recent)):
                return True
            return any(sh.world != world or sh.step >= step for sh in self.held.values())

    def forget_stale(self, step: int, world: int) -> None:
        """Free copies that can no longer be restored or belong to an abandoned run.

        A different world size cannot be served (the persistent tier reshards instead); steps
        >= `step` are from before a rewind (training restarted from an older checkpoint), and
        restoring them later would jump back onto the abandoned trajectory. The caller makes
        sure no background work still reads them.
        """
        with self._lock:
            stale = [k for k, sh in self.held.items() if sh.world != world or sh.step >= step]
            for key in stale:
                self._free.append(self.held.pop(key).buf)
            self._confirmed = [c for c in self._confirmed if c < step]
            self._recent = [r for r in self._recent if r < step]
            self._ok = {r for r in self._ok if r < step}

    def forget_after(self, step: int) -> list[tuple[int, int]]:
        """Free every copy (own and replicas) of a step newer than ``step``: distrusted (a
        finding of silent data corruption). The (step, owner) of each freed; the caller made
        sure no background work still reads them."""
        with self._lock:
            gone = sorted(k for k in self.held if k[0] > step)
            for key in gone:
                self._free.append(self.held.pop(key).buf)
            self._confirmed = [c for c in self._confirmed if c <= step]
            self._recent = [r for r in self._recent if r <= step]
            self._ok = {r for r in self._ok if r <= step}
            return gone

    def make_room(self) -> None:
        """Before a save takes its buffer: free the recent steps beyond the newest
        UNCONFIRMED_KEPT - 1, so that the buffer they free is the one the save reuses. Their
        background work is over (save() waited for it); the newest step stays held while the
        new one is copied, so a fault during the copy still finds it."""
        with self._lock:
            self._trim_recent(UNCONFIRMED_KEPT - 1)

    def add_own(self, shard: Shard) -> None:
        """Hold a shard this rank just packed, as the newest recent step."""
        with self._lock:
            self.held[(shard.step, shard.owner)] = shard
            self._recent.append(shard.step)
            self._trim_recent(UNCONFIRMED_KEPT)

    def used_bytes(self) -> int:
        with self._lock:
            return sum(s.nbytes for s in self.held.values())

    def shards(self) -> list[Shard]:
        with self._lock:
            return list(self.held.values())

    def clear(self) -> None:
        with self._lock:
            self.held.clear()
            self._free.clear()

    # ------------------------------------------------------------- background thread

    def add_replica(self, shard: Shard) -> None:
        with self._lock:
            self.held[(shard.step, shard.owner)] = shard

    def mark_ok(self, step: int) -> None:
        """This rank's part of `step` (copy, file, replicas) is complete."""
        with self._lock:
            if step in self._recent:
                self._ok.add(step)

    def offered(self) -> list[int]:
        """The recent steps complete here: what this rank offers to the agreement."""
        with self._lock:
            return sorted(self._ok)

    def confirm(self, step: int) -> None:
        """`step` is complete on every rank: keep it (and the newest keep - 1 confirmed before
        it); free every older step and every recent one before it."""
        with self._lock:
            self._confirmed = sorted({*self._confirmed, step})[-self._keep :]
            self._recent = [r for r in self._recent if r > step]
            self._ok = {r for r in self._ok if r > step}
            self._free_unkept()

    def disk_kept(self) -> tuple[set[int], int]:
        """(confirmed steps, first kept recent step): the node-local directory keeps the
        confirmed steps and every step from the oldest recent one on (when none is recent: from
        the step after the newest confirmed one)."""
        with self._lock:
            recent_min = min(self._recent, default=max(self._confirmed, default=0) + 1)
            return set(self._confirmed), recent_min

    def _trim_recent(self, n: int) -> None:
        if len(self._recent) > n:
            self._recent = self._recent[len(self._recent) - n :]
            self._ok &= set(self._recent)
            self._free_unkept()

    def _free_unkept(self) -> None:
        kept = {*self._confirmed, *self._recent}
        newest = max(kept, default=-1)
        for key in [k for k in self.held if k[0] not in kept and k[0] < newest]:
            self._free.append(self.held.pop(key).buf)
