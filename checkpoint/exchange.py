"""Small-object exchange between the ranks of one background save, over the job's store.

Why not a process group: a background thread blocked inside a gloo collective cannot be
released from Python. When an in-process restart destroys the process groups while such a
collective is in flight, the peers' sockets stay open (the blocked thread holds the group), and
tearing the group down can block the whole process, GIL held, until the group's timeout. Here
every wait is a poll of non-blocking store calls (``check``, then ``get`` of a key known to
exist) that also watches a cancel event, so a save is abandoned within milliseconds of the
restart noticing it, and no process group is touched outside the training thread.

The store is the default process group's (``PrefixStore`` under the launcher's TCPStore); the
keys live under a namespace that every rank derives identically for one save attempt.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from restartable.checkpoint import _torch_private, plain, store_delete
from restartable.checkpoint.errors import CheckpointAbandoned, CheckpointError
from restartable.checkpoint.sealing import ForgedValueError, Sealer, job_sealer, parse_count

if TYPE_CHECKING:
    import torch.distributed as dist

log = logging.getLogger(__name__)

# Polls double from 1 ms up to 4 ms for the first 0.2 s (a per-step agreement of the local tier
# is over in milliseconds, and a late poll delays the next save), then up to 50 ms: a long wait
# (a persistent write on a slow rank) must not flood the store of a large job with requests.
_POLL_FIRST_S = 0.001
_POLL_FAST_MAX_S = 0.004
_FAST_WINDOW_S = 0.2
_POLL_MAX_S = 0.05
_ABANDONED = "abandoned"  # the key a rank sets when it abandons an attempt (see abandon())
# Job-wide bound of the polls every waiting rank sends together (per second): each rank's pause
# is at least world / this, so a job of thousands of ranks cannot flood the store server (one
# poll is one small request) and the waits grow linearly with the job, not faster
# (docs/scale.md). Small jobs keep the pauses above.
_JOB_POLLS_PER_S = 20_000.0


class StoreExchange:
    """Gather to rank 0 and publish from rank 0, through keys under ``namespace``.

    Created on the training thread at ``save()`` (one per save attempt), used only by the
    background worker. ``store=None`` means a single process: every call returns at once.
    Every wait is bounded by ``timeout`` seconds and ends early, with ``CheckpointAbandoned``,
    once ``cancel`` is set. Values travel as plain data (``checkpoint.plain``), sealed with the
    job's secret when ``sealer`` is given (``checkpoint.sealing``): a value that fails is
    rejected (``CheckpointError`` naming the key) and never decoded.
    """

    def __init__(
        self,
        store: dist.Store | None,
        namespace: str,
        *,
        rank: int,
        world: int,
        cancel: threading.Event,
        timeout: float,
        sealer: Sealer | None = None,
    ) -> None:
        self.rank = rank
        self.world = world
        self.namespace = namespace
        self.cancel = cancel  # set by the training thread when the attempt must be abandoned
        self._store = store
        self._timeout = timeout
        self._sealer = sealer
        self._solo: dict[str, Any] = {}
        # Rank 0: gathered keys to delete once the answer is published (see gather()).
        self._garbage: list[str] = []

    def gather(self, name: str, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on rank 0 (indexed by rank); None on the other ranks.

        Rank 0 publishes its answer next and then calls ``receive``, which deletes the
        gathered keys."""
        if self._store is None:
            return [obj]
        self._put(self._key(name, self.rank), obj)
        # Arrivals are counted after the value is stored, so rank 0 polls ONE counter (a poll
        # of every rank's key costs the server O(world) per poll), then reads all values at once.
        count = self._key(name, None) + "/n"
        self._store.add(count, 1)
        if self.rank != 0:
            return None
        keys = [self._key(name, r) for r in range(self.world)]
        self._wait(
            keys, name, ready=lambda: parse_count(count, self._peers.get(count)) >= self.world
        )
        blobs = self._store.multi_get(keys)
        # Deleted at rank 0's next receive(), after it published the answer: the deletes are
        # one call per rank (c10d has no multi-delete), and made here they kept every peer
        # waiting for the answer (at 1,024 ranks most of a step agreement's time).
        self._garbage.extend([*keys, count])
        return [self._decode(k, b) for k, b in zip(keys, blobs, strict=True)]

    def publish(self, name: str, obj: Any, *, to: int | None = None) -> None:
        """Rank 0: make ``obj`` readable by ``receive(name)`` on rank ``to`` (None: every rank)."""
        if self._store is None:
            self._solo[name] = obj
            return
        self._put(self._key(name, to), obj)

    def receive(self, name: str, *, mine: bool = False) -> Any:
        """Wait for rank 0's ``publish(name)``; ``mine``: the value published to this rank only
        (deleted once read, nobody else reads it)."""
        if self._store is None:
            return self._solo.pop(name)
        garbage, self._garbage = self._garbage, []
        for k in garbage:
            self._delete(k)
        key = self._key(name, self.rank if mine else None)
        self._wait([key], name, from_rank=0)
        value = self._decode(key, self._store.get(key))
        if mine:
            self._delete(key)
        return value

    def abandon(self) -> None:
        """Training thread: stop this attempt here and tell the peers (not collective).

        Sets ``cancel`` (this rank's worker stops at its next wait or file write) and publishes
        the attempt's ``abandoned`` key, which ends the waits of every peer's worker for this
        attempt within one slow poll. Without it, a rank that never reaches its own abandon
        point (a rank sent to the reserve pool, a process past the end of ``train()``) would
        wait for peers that left, up to the save timeout, and hold its process's exit.
        Best effort: a store that is gone leaves the peers to their own timeout or cancel.
        """
        self.cancel.set()
        if self._store is None:
            return
        try:
            self._store.set(self._key(_ABANDONED, None), "1")
        except Exception as e:  # the store's host is gone: nothing to tell anyone
            log.debug("checkpoint: could not publish the abandon of %s: %s", self.namespace, e)

    def discard(self, name: str) -> None:
        """Rank 0: delete a value published to every rank once all of them have read it."""
        if self._store is not None:
            self._delete(self._key(name, None))

    def _put(self, key: str, obj: Any) -> None:
        data = plain.dumps(obj)
        value = data if self._sealer is None else self._sealer.seal(key, data)
        self._peers.set(key, value)  # type: ignore[arg-type]  # torch's stub: str; bytes work

    def _decode(self, key: str, raw: bytes) -> Any:
        """A value read from ``key``: verified first (never decoded when forged), then decoded
        as plain data."""
        try:
            data = raw if self._sealer is None else self._sealer.open(key, raw)
            return plain.loads(data)
        except (ForgedValueError, plain.PlainDataError) as exc:
            log.error("checkpoint: %s", exc)
            raise CheckpointError(f"save exchange: {exc}") from exc

    def _delete(self, key: str) -> None:
        store_delete.delete_key(self._peers, key)

    def _key(self, name: str, rank: int | None) -> str:
        return f"{self.namespace}/{name}" if rank is None else f"{self.namespace}/{name}/{rank}"

    def _wait(
        self,
        keys: list[str],
        name: str,
        *,
        from_rank: int | None = None,
        ready: Callable[[], bool] | None = None,
    ) -> None:
        """Poll until ``ready()`` (default: every key of ``keys`` exists); bounded as above."""
        start = time.monotonic()
        end = start + self._timeout
        pause = _POLL_FIRST_S
        floor = self.world / _JOB_POLLS_PER_S
        abandoned = [self._key(_ABANDONED, None)]
        if ready is None:
            ready = functools.partial(self._peers.check, keys)
        while not ready():
            if self.cancel.is_set():
                raise CheckpointAbandoned(f"abandoned while waiting for '{name}'")
            # Only in the slow phase: a peer's abandon is rare, a per-step agreement is not.
            if pause >= _POLL_MAX_S and self._peers.check(abandoned):
                raise CheckpointAbandoned(f"a peer abandoned the save while waiting for '{name}'")
            if time.monotonic() > end:
                missing = [from_rank] if from_rank is not None else self._missing(keys)
                raise CheckpointError(
                    f"rank(s) {missing} did not reach '{name}' of the save within "
                    f"{self._timeout:.0f} s (timeout): a rank stopped or its storage hung"
                )
            # Wait on the event, not time.sleep: cancel() wakes the worker at once.
            self.cancel.wait(max(pause, floor))
            fast = time.monotonic() - start < _FAST_WINDOW_S
            pause = min(pause * 2, _POLL_FAST_MAX_S if fast else _POLL_MAX_S)

    def _missing(self, keys: list[str]) -> list[int]:
        return [r for r, k in enumerate(keys) if not self._peers.check([k])]

    @property
    def _peers(self) -> dist.Store:
        """The store of a multi-rank exchange (a single process never polls nor writes)."""
        assert self._store is not None
        return self._store


class Attempts:
    """Names successive background operations of one kind identically on every rank.

    An attempt's namespace is ``{kind}/{group token}/{count of attempts since the group was
    created}``: the token is agreed when the group is created (``BackgroundGroup.token``) and the
    count is the same everywhere because the calls that start attempts are collective. Used from
    the training thread only.
    """

    def __init__(self, kind: str, *, timeout: float) -> None:
        self._kind = kind
        self._timeout = timeout
        self._token: str | None = None
        self._seq = 0
        self._last: StoreExchange | None = None
        self._sealer: Sealer | None = None  # read once, at the first attempt over a group

    def next(self, group: Any, token: str | None) -> tuple[StoreExchange, StoreExchange | None]:
        """The exchange of a new attempt over ``group`` (None: one process), with a fresh
        ``cancel`` event, and the previous attempt's in the same group (None after a rebind),
        whose leftover keys rank 0 deletes once every rank has reached the new one."""
        cancel = threading.Event()
        if group is None:
            self._token, self._last = None, None
            return StoreExchange(
                None, "", rank=0, world=1, cancel=cancel, timeout=self._timeout
            ), None
        import torch.distributed as dist

        if token != self._token:
            self._token, self._seq, self._last = token, 0, None
        if self._sealer is None:
            self._sealer = job_sealer()
        self._seq += 1
        ex = StoreExchange(
            _torch_private.default_store(),
            f"restartable/ckpt/{self._kind}/{token}/{self._seq}",
            rank=dist.get_rank(group),
            world=dist.get_world_size(group),
            cancel=cancel,
            timeout=self._timeout,
            sealer=self._sealer,
        )
        previous, self._last = self._last, ex
        return ex, previous
