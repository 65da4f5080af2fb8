"""One etcd watch of one key, read by a thread of its own until the key's first put, the stream's
end, or ``close()``: the waiter blocks on an event, not on the socket, so its deadline never
breaks a healthy stream (a socket read timeout would: Python's socket file refuses every read
after one) and the same stream can serve the next wait for the key (``inprocess.etcd.watch``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
from collections.abc import Iterator
from typing import Any

from restartable.inprocess.etcd import txn as t
from restartable.inprocess.etcd.endpoints import WATCH_IDLE_S, Endpoints, Transient, classify

log = logging.getLogger(__name__)

# The gateway forwards ``Grpc-Metadata-*`` headers as gRPC metadata: ``hasleader`` is what etcd's
# own client sends (``WithRequireLeader``) so that a member cut off from its leader cancels the
# watch (after a few election timeouts) instead of keeping a stream no put will ever reach.
_REQUIRE_LEADER = {"Grpc-Metadata-hasleader": "true"}


class WatchStream:
    """A watch of ``key`` (its full etcd key) on the endpoints' current member, opened at once.

    ``ready`` is set once etcd confirmed the watch (``created``) or the stream ended;
    ``done`` once it delivered a value (``value``) or ended (``value`` None; ``error``: the
    ``Transient`` that ended it, when opening failed). A stream silent for ``WATCH_IDLE_S``
    ends (a member that hangs without closing the connection); a killed member ends it at once.
    Safe to ``close()`` from any thread, more than once."""

    def __init__(self, endpoints: Endpoints, key: bytes) -> None:
        self.endpoints, self.key = endpoints, key
        self.index, self._client = endpoints.current()
        self.ready, self.done = threading.Event(), threading.Event()
        self.created = False
        self.value: bytes | None = None
        self.error: Transient | None = None
        self._lock = threading.Lock()
        self._response: Any = None
        self._closed = False
        name = f"etcd-watch-{key.decode(errors='replace')[-40:]}"
        threading.Thread(target=self._run, name=name, daemon=True).start()

    @property
    def where(self) -> str:
        host, port = self.endpoints.address.endpoints[self.index]
        return f"{host}:{port}"

    def alive(self) -> bool:
        """Confirmed by etcd and neither ended nor closed: any later put of the key reaches it."""
        return self.created and not self.done.is_set() and not self._closed

    def close(self) -> None:
        """End the stream and its thread (the socket is shut down to wake a blocked read)."""
        with self._lock:
            self._closed, response = True, self._response
        if response is not None:
            _shut(response)

    def _run(self) -> None:
        try:
            response = classify(self._open)
        except Transient as exc:
            self.error = exc
            self._finish()
            return
        with self._lock:
            self._response = response
            closed = self._closed
        try:
            if not closed:
                self._read(response)
        except _requests_errors() as exc:  # idle past WATCH_IDLE_S, or a broken stream
            log.debug("etcd watch of %r on %s ended: %r", self.key, self.where, exc)
        except (OSError, ValueError) as exc:  # closed under the read
            log.debug("etcd watch of %r on %s closed: %r", self.key, self.where, exc)
        finally:
            _shut(response)
            self._finish()

    def _open(self) -> Any:
        self.endpoints.authenticate(self.index, self._client)
        body = {"create_request": {"key": t.b64(self.key), "filters": ["NODELETE"]}}
        return self._client.session.post(
            self._client.get_url("/watch"),
            json=body,
            stream=True,
            headers=_REQUIRE_LEADER,
            timeout=(self.endpoints.request_timeout, WATCH_IDLE_S),
        )

    def _read(self, response: Any) -> None:
        for message in _messages(response):
            result = message.get("result", {})
            if result.get("created"):
                self.created = True
                self.ready.set()
            for event in result.get("events", []):
                self.value = t.unb64(event.get("kv", {}).get("value", ""))
                return
            if result.get("canceled"):  # e.g. the member lost its leader (hasleader)
                log.debug("etcd watch of %r on %s canceled: %s", self.key, self.where, result)
                return

    def _finish(self) -> None:
        self.done.set()
        self.ready.set()


def _shut(response: Any) -> None:
    """Close a streamed response; shut its socket down first: closing alone does not wake a
    thread blocked reading it."""
    sock = getattr(getattr(response.raw, "connection", None), "sock", None)
    if isinstance(sock, socket.socket):
        with contextlib.suppress(OSError):  # already closed by the peer
            sock.shutdown(socket.SHUT_RDWR)
    response.close()


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
