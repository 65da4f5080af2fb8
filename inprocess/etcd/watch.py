"""Blocking until a key exists on etcd: one read, then watch slices (each re-reads the key once
its watch exists, so no put between the read and the watch is missed)."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Iterator
from typing import Any

from restartable.inprocess.etcd import txn as t
from restartable.inprocess.etcd.endpoints import Endpoints, Transient, classify
from restartable.inprocess.etcd.errors import EtcdTimeoutError

log = logging.getLogger(__name__)

# A watch is re-armed this often while a wait goes on: a watch whose member died ends silently
# in etcd3gw, so this bounds the stall a lost member adds to a waiter (the issue's "short
# stall"), at the cost of one range + one watch request per waiter per period.
WATCH_SLICE_S = 1.0


class KeyWait:
    """One wait for one key (``key``: its full etcd key; ``read(deadline)``: the key's value or
    None, one range request). ``name`` and ``where`` only word the timeout error."""

    def __init__(
        self,
        endpoints: Endpoints,
        key: bytes,
        read: Callable[[float], bytes | None],
        *,
        name: str,
        where: str,
    ) -> None:
        self.endpoints, self.key, self.read = endpoints, key, read
        self.name, self.where = name, where

    def value(self, deadline: float, bound: float) -> bytes:
        """The key's value once it exists; ``EtcdTimeoutError`` after ``deadline`` (the
        endpoints' ``clock.monotonic()``; ``bound``: the timeout in seconds, for the message)."""
        value = self.read(deadline)
        while value is None:
            value = self._slice(deadline, bound)
        return value

    def _slice(self, deadline: float, bound: float) -> bytes | None:
        """The value, or None after one watch slice or a failed watch with the key still absent.

        The watch starts at the current revision and the key is read once etcd confirmed it: a
        put before that confirmation is seen by the read, a later one by the watch. Not a watch
        from the revision of an earlier read: etcd serves a watch that starts in the past from
        its catch-up loop, which runs every 100 ms (measured here: woken 38-77 ms after the put
        instead of 4-5 ms; the job's other writes move the revision on between the read and the
        watch almost every time)."""
        left = deadline - self.endpoints.clock.monotonic()
        if left <= 0:
            raise EtcdTimeoutError(
                f"etcd store {self.where}: key {self.name!r} did not appear within the timeout "
                f"({bound:.3g} s)"
            )
        index, client = self.endpoints.current()
        body = {"create_request": {"key": t.b64(self.key), "filters": ["NODELETE"]}}

        def open_watch() -> Any:
            self.endpoints.authenticate(index, client)
            return client.session.post(
                client.get_url("/watch"),
                json=body,
                stream=True,
                timeout=(self.endpoints.request_timeout, min(left, WATCH_SLICE_S)),
            )

        try:
            stream = classify(open_watch)
        except Transient as exc:
            log.debug("etcd watch on %s failed: %s", self.endpoints.address.endpoints[index], exc)
            self.endpoints.failed(index, exc)
            # A read instead: paced by the endpoints' fail-over, which raises, naming them, when
            # none answers (a failed watch alone would be retried at once).
            return self.read(deadline)
        with contextlib.closing(stream):
            return self._watched(stream, deadline, index)

    def _watched(self, stream: Any, deadline: float, index: int) -> bytes | None:
        messages = _messages(stream)
        try:
            created = any(m.get("result", {}).get("created") for m in messages)
            value = self.read(deadline)
            if value is not None or not created:  # not created: the stream ended first
                return value
            for m in messages:
                for event in m.get("result", {}).get("events", []):
                    return t.unb64(event.get("kv", {}).get("value", ""))
        except _requests_errors() as exc:  # the slice's read timeout, or a broken stream
            where = self.endpoints.address.endpoints[index]
            log.debug("etcd watch slice on %s ended: %r", where, exc)
        return None


def _messages(stream: Any) -> Iterator[dict[str, Any]]:
    """The JSON messages of a gateway watch stream (one per line), as they arrive."""
    pending = b""
    for chunk in stream.iter_content(chunk_size=None):
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            if line.strip():
                yield json.loads(line)


def _requests_errors() -> tuple[type[BaseException], ...]:
    import requests

    return (requests.exceptions.RequestException,)
