"""Blocking until a key exists on etcd: one read, then one watch, kept while it is healthy.

A wait reads the key; when it is absent it opens a watch (``WatchStream``) and reads the key
again once etcd confirmed the watch, so no put between the read and the watch is missed. The
watch then stays open until the key's put, the stream's end (a killed member, a member that
lost its leader, ``WATCH_IDLE_S`` of silence: re-armed, on the next member when opening fails),
or the wait's deadline, which the waiter keeps by a timed wait on the stream's event. A watch
still healthy at the deadline is kept (``Watches``) for the next wait of the same key: a caller
that waits in short slices (a launcher's relay re-checking between its 1 s ``get`` calls) costs
etcd nothing between its slices.

Until 2 December 2026 every wait re-armed its watch every second (a new connection, a watch
and a read per waiter and second): 128 relays waiting for an iteration's end spent 2.1-2.7 s of
CPU on it, and the three members theirs (docs/scale.md, "On etcd").
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from restartable.inprocess.etcd.endpoints import Endpoints
from restartable.inprocess.etcd.errors import EtcdTimeoutError
from restartable.inprocess.etcd.watch_stream import WatchStream

# Streams kept for later waits at most (each a connection and a thread; a kept stream of a key
# nobody waits for again ends by itself after ``WATCH_IDLE_S`` of silence or at the key's put).
MAX_KEPT = 64


class Watches:
    """The watches of one store client (thread-safe): ``await_value`` blocks on one, keeps it
    for the key's next wait when its deadline passes first; ``close()`` ends them all."""

    def __init__(self, endpoints: Endpoints) -> None:
        self.endpoints = endpoints
        self._lock = threading.Lock()
        self._kept: dict[bytes, WatchStream] = {}
        self._open: set[WatchStream] = set()

    def await_value(
        self,
        key: bytes,
        read: Callable[[float], bytes | None],
        deadline: float,
        *,
        what: str,
    ) -> bytes:
        """The value of ``key`` (its full etcd key) once it exists: ``read(deadline)`` is one
        range request (None: absent). ``EtcdTimeoutError`` naming ``what`` (the key, the cluster
        and the bound) after ``deadline`` (the endpoints' ``clock.monotonic()``)."""
        stream = self._take(key)
        value = None if stream is not None else read(deadline)
        while value is None:
            left = deadline - self.endpoints.clock.monotonic()
            if left <= 0:
                if stream is not None:
                    self._keep(key, stream)
                raise EtcdTimeoutError(f"etcd store {what}")
            if stream is None:
                stream, value = self._arm(key, read, deadline, left)
            elif stream.done.wait(left):  # else the deadline, checked by the clock above
                self._drop(stream)
                value, stream = stream.value, None  # None: it ended; re-armed (a read first)
        return value

    def _arm(
        self, key: bytes, read: Callable[[float], bytes | None], deadline: float, left: float
    ) -> tuple[WatchStream | None, bytes | None]:
        """Open a watch and read the key once it is confirmed: (the stream, None) while the key
        is absent, (None, its value) when present, (None, None) when the deadline came first.
        A watch that ended unconfirmed (the member refused or dropped it, or did not answer)
        moves the endpoints on and the key is read instead: paced by their fail-over, which
        raises naming them when none answers, where a failed watch alone would be retried at
        once."""
        stream = WatchStream(self.endpoints, key)
        with self._lock:
            self._open.add(stream)
        stream.ready.wait(left)
        if stream.created:
            try:
                value = read(deadline)
            except BaseException:
                self._drop(stream)
                raise
            if value is None:
                return stream, None
            self._drop(stream)
            return None, value
        self._drop(stream)
        if not stream.done.is_set():
            return None, None  # the deadline: the caller raises
        if stream.error is not None:
            self.endpoints.failed(stream.index, stream.error)
        else:
            self.endpoints.fail_over(stream.index)
        return None, read(deadline)

    def _take(self, key: bytes) -> WatchStream | None:
        """The kept watch of ``key`` when it is still alive (a put after the previous wait's
        read reaches it); a kept one that ended or saw a put is dropped (the put's value may be
        stale by now: the wait reads the key instead)."""
        with self._lock:
            stream = self._kept.pop(key, None)
        if stream is not None and not stream.alive():
            self._drop(stream)
            return None
        return stream

    def _keep(self, key: bytes, stream: WatchStream) -> None:
        if not stream.alive():
            self._drop(stream)
            return
        with self._lock:
            for k, s in list(self._kept.items()):  # ended ones, then the oldest past the bound
                if not s.alive() or len(self._kept) >= MAX_KEPT:
                    self._kept.pop(k)
                    self._open.discard(s)
                    s.close()
            other = self._kept.pop(key, None)
            self._kept[key] = stream
        if other is not None:  # two waiters of one key timed out together: one stream kept
            self._drop(other)

    def _drop(self, stream: WatchStream) -> None:
        with self._lock:
            self._open.discard(stream)
        stream.close()

    def close(self) -> None:
        """End every watch of this client, kept or in use (their waits re-arm if they go on)."""
        with self._lock:
            streams, self._open, self._kept = list(self._open), set(), {}
        for s in streams:
            s.close()
