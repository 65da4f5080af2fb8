"""A small pure-Python client of torch's TCPStore wire protocol, for processes that must not
import torch (the watchdog: a few MB and milliseconds to start instead of ~220 MB and a second).

The protocol is torch's private contract (``torch/csrc/distributed/c10d/TCPStore.cpp`` and
``TCPStoreBackend.hpp``); tests/unit/test_tcpstore_client.py runs every call against the real
torch server, so a change in torch fails there loudly. Layout: a request is one byte (the query
type) followed by its arguments; a string or byte value is a little-endian uint64 length and
the bytes; an integer is a little-endian int64; every key gets torch's ``/`` prefix. A new
connection sends VALIDATE with the magic number, then PING with a nonce that the server echoes.
The client is a ``inprocess.protocol.store.Store`` of its own (the protocol's operations from
``StoreBase``), so tests/unit/test_store_conformance.py runs the same suite against it.
"""

from __future__ import annotations

import datetime
import os
import select
import socket
import struct
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, NoReturn

from restartable.inprocess.clock import SYSTEM, Clock
from restartable.inprocess.protocol.store import Store, StoreBase

_VALIDATE, _SET, _COMPARE_SET, _GET, _ADD, _CHECK, _WAIT = range(7)
_DELETE_KEY, _APPEND, _MULTI_GET, _MULTI_SET, _CANCEL_WAIT, _PING = 8, 9, 10, 11, 12, 13
_MAGIC = 0x3C85F7CE
_READY = 0  # CHECK's answer when every key exists
_STOP_WAITING, _WAIT_CANCELED = 0, 1
_KEY_PREFIX = b"/"  # torch's client prefixes every key


class StoreClientError(RuntimeError):
    """The server broke the protocol or closed the connection."""


class TCPStoreClient(StoreBase):
    """A client connection to a ``torch.distributed.TCPStore`` server (``is_master=False``), as
    a ``Store``.

    Same call signatures and answers as torch's client for ``set``, ``get``, ``add``,
    ``append``, ``compare_set``, ``check``, ``wait``, ``multi_get``, ``multi_set``,
    ``delete_key``; the fast paths are ``StoreBase``'s, as for torch's client in a
    ``C10dStore``. ``timeout`` bounds the blocking ``get`` and ``wait`` (``TimeoutError``);
    ``connect_timeout`` (default: ``timeout``) bounds the connection, then every answer of the
    server (a client that waits in short slices, the launcher's relay, still connects to a
    server slow under load); ``clock`` paces the retries of a refused connection. Calls are
    serialized by a lock; ``close()`` is idempotent. There is no torch store under it
    (``torch_store`` raises ``TypeError``).
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        timeout: float,
        connect_timeout: float | None = None,
        clock: Clock = SYSTEM,
    ) -> None:
        self.timeout = timeout
        self._lock = threading.Lock()
        bound = timeout if connect_timeout is None else connect_timeout
        deadline = clock.monotonic() + bound
        try:
            while True:  # the server may still be starting: retry refused connections
                try:
                    self._sock = socket.create_connection((host, port), timeout=bound)
                    break
                except ConnectionRefusedError:
                    if clock.monotonic() >= deadline:
                        raise
                    clock.sleep(0.05)
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            nonce = os.getpid() & 0xFFFFFFFF
            self._send(struct.pack("<BI", _VALIDATE, _MAGIC) + struct.pack("<BI", _PING, nonce))
            answer = self._recv(4)
        except TimeoutError as exc:
            raise TimeoutError(
                f"the store at {host}:{port} did not answer within the connect timeout "
                f"({bound:.3g} s): its server is down or overloaded; raise the timeout if the "
                "server is known to be busy"
            ) from exc
        if struct.unpack("<I", answer)[0] != nonce:
            raise StoreClientError(f"store at {host}:{port} answered PING with another nonce")

    # ----- calls -----------------------------------------------------------------------------

    def set(self, key: str, value: str | bytes) -> None:
        with self._lock:
            self._send(bytes([_SET]) + _str(_key(key)) + _str(_bytes(value)))

    def get(self, key: str) -> bytes:
        """Waits (at most ``timeout``) for ``key``, as torch's client does, then reads it."""
        return self.wait_value(key, datetime.timedelta(seconds=self.timeout))

    def wait_value(self, key: str, timeout: datetime.timedelta) -> bytes:
        """``StoreBase.wait_value`` in two round trips, not three: after its own ``wait`` the
        key exists (the protocol deletes no key it waits for), so the ``GET`` needs no second
        ``wait`` (``get``'s). The node path's ranks wait on their node store this way."""
        self.wait([key], timeout)
        with self._lock:
            self._send(bytes([_GET]) + _str(_key(key)))
            return self._recv_bytes()

    def add(self, key: str, value: int) -> int:
        with self._lock:
            self._send(bytes([_ADD]) + _str(_key(key)) + struct.pack("<q", value))
            return int(struct.unpack("<q", self._recv(8))[0])

    def append(self, key: str, value: str | bytes) -> None:
        with self._lock:
            self._send(bytes([_APPEND]) + _str(_key(key)) + _str(_bytes(value)))

    def compare_set(
        self, key: str, expected_value: str | bytes, desired_value: str | bytes
    ) -> bytes:
        with self._lock:
            self._send(
                bytes([_COMPARE_SET])
                + _str(_key(key))
                + _str(_bytes(expected_value))
                + _str(_bytes(desired_value))
            )
            return self._recv_bytes()

    def check(self, keys: Sequence[str]) -> bool:
        with self._lock:
            self._send(bytes([_CHECK]) + _keys(keys))
            return self._recv(1)[0] == _READY

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """Waits (at most ``timeout``) for every key, as torch's client does, then reads them."""
        self.wait(keys, datetime.timedelta(seconds=self.timeout))
        with self._lock:
            self._send(bytes([_MULTI_GET]) + _keys(keys))
            return [self._recv_bytes() for _ in keys]

    def delete_key(self, key: str) -> bool:
        with self._lock:
            self._send(bytes([_DELETE_KEY]) + _str(_key(key)))
            return int(struct.unpack("<q", self._recv(8))[0]) == 1

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        if len(keys) != len(values):
            raise ValueError(f"multi_set: {len(keys)} keys but {len(values)} values")
        pairs = b"".join(_str(_key(k)) + _str(_bytes(v)) for k, v in zip(keys, values, strict=True))
        with self._lock:
            self._send(bytes([_MULTI_SET]) + struct.pack("<Q", len(keys)) + pairs)

    def wait(self, keys: Sequence[str], timeout: datetime.timedelta | None = None) -> None:
        """Block until every key exists; ``TimeoutError`` after ``timeout`` (then the server is
        told to stop waiting, and its answer is read, so the connection stays in step)."""
        seconds = self.timeout if timeout is None else timeout.total_seconds()
        with self._lock:
            self._send(bytes([_WAIT]) + _keys(keys))
            if select.select([self._sock], [], [], seconds)[0]:
                self._expect(self._recv(1)[0], _STOP_WAITING)
                return
            self._send(bytes([_CANCEL_WAIT]))
            # The keys may have appeared meanwhile: STOP_WAITING first, then the cancel's answer.
            answer = self._recv(1)[0]
            if answer == _STOP_WAITING:
                self._expect(self._recv(1)[0], _WAIT_CANCELED)
                return
            self._expect(answer, _WAIT_CANCELED)
        raise TimeoutError(f"wait timeout after {seconds} s, keys: {keys}")

    def close(self) -> None:
        self._sock.close()

    def torch_store(self) -> NoReturn:
        raise TypeError(
            "TCPStoreClient has no torch.distributed.Store under it (it exists so that the "
            "watchdog never imports torch): open torch's TCPStore for a process group"
        )

    # ----- bytes -----------------------------------------------------------------------------

    def _send(self, data: bytes) -> None:
        self._sock.sendall(data)

    def _recv(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = self._sock.recv(n - len(buf))
            if not chunk:
                raise StoreClientError("the store closed the connection")
            buf += chunk
        return buf

    def _recv_bytes(self) -> bytes:
        (n,) = struct.unpack("<Q", self._recv(8))
        return self._recv(n) if n else b""

    @staticmethod
    def _expect(got: int, want: int) -> None:
        if got != want:
            raise StoreClientError(f"unexpected answer {got} from the store (expected {want})")


def _bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _key(key: str) -> bytes:
    return _KEY_PREFIX + key.encode()


def _str(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


def _keys(keys: Sequence[str]) -> bytes:
    return struct.pack("<Q", len(keys)) + b"".join(_str(_key(k)) for k in keys)


if TYPE_CHECKING:

    def _implements_store(store: TCPStoreClient) -> Store:  # mypy checks it against Store
        return store
