"""The coordination store as the framework's own processes see it: every value sealed.

``SealedStore`` wraps a store client (TCPStore or ``EtcdStore``): values written through it
carry a MAC over key and value (``checkpoint.sealing``), and values read through it are verified
before anyone parses them; a value that fails raises ``ForgedValueError`` naming the key, and
is logged at ERROR once per key. Counters (``add``, ``count_arrival``) hold integers the server
adds to and cannot be sealed: a forged count can release a barrier early, which ends in a fault
or a barrier timeout (an error), never in a sealed decision (docs/security.md).

torch's process groups and ``ctx.store`` use the unsealed client (``unsealed``): their values are
torch's own, written and read by C++.
"""

from __future__ import annotations

import datetime
import logging
import threading
from collections.abc import Sequence
from typing import Any

from checkpoint.sealing import ForgedValueError, Sealer

log = logging.getLogger(__name__)

__all__ = ["ForgedValueError", "SealedStore", "seal", "unsealed"]

# Methods of the inner store that SealedStore offers only where the inner store has them
# (inprocess.protocol.keys tests for them with getattr to pick the one-round-trip path).
_OPTIONAL = (
    "try_get",
    "try_get_many",
    "wait_value",
    "multi_set",
    "multi_get",
    "record_fault_batch",
)


class SealedStore:
    """A store client whose values are sealed with the job's secret (see the module docstring).

    Thread-safe as far as the inner client is. ``raw`` is the inner client. Anything not listed
    here (``add``, ``check``, ``wait``, ``delete_key``, ``count_arrival``, ``close``, ...) is the
    inner client's own.
    """

    def __init__(self, inner: Any, sealer: Sealer) -> None:
        self.raw = inner
        self._sealer = sealer
        self._reported: set[str] = set()
        self._lock = threading.Lock()
        for name in _OPTIONAL:
            if callable(getattr(inner, name, None)):
                setattr(self, name, getattr(self, f"_{name}"))

    def __getattr__(self, name: str) -> Any:
        if name in _OPTIONAL or name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.raw, name)

    def __enter__(self) -> SealedStore:
        return self

    def __exit__(self, *exc: object) -> None:
        close = getattr(self.raw, "close", None)
        if close is not None:
            close()

    # ----- sealing --------------------------------------------------------------------------

    def _open(self, key: str, raw: bytes) -> bytes:
        try:
            return self._sealer.open(key, raw)
        except ForgedValueError as exc:
            with self._lock:
                first = key not in self._reported
                self._reported.add(key)
            if first:
                log.error("%s", exc)
            raise

    def set(self, key: str, value: str | bytes) -> None:
        self.raw.set(key, self._sealer.seal(key, value))

    def get(self, key: str) -> bytes:
        return self._open(key, self.raw.get(key))

    def append(self, key: str, value: str | bytes) -> None:
        self.raw.append(key, self._sealer.seal(key, value))

    def compare_set(
        self, key: str, expected_value: str | bytes, desired_value: str | bytes
    ) -> bytes:
        """First writer wins as before: sealing is deterministic, so an expected value compares
        equal to its sealed form; ``""`` (absent) stays ``""``."""
        expected = self._sealer.seal(key, expected_value) if expected_value else b""
        got = self.raw.compare_set(key, expected, self._sealer.seal(key, desired_value))
        return self._open(key, got)

    def _try_get(self, key: str) -> bytes | None:
        value = self.raw.try_get(key)
        return None if value is None else self._open(key, value)

    def _try_get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        values = self.raw.try_get_many(list(keys))
        return [None if v is None else self._open(k, v) for k, v in zip(keys, values, strict=True)]

    def _wait_value(self, key: str, timeout: datetime.timedelta) -> bytes:
        return self._open(key, self.raw.wait_value(key, timeout))

    def _multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        sealed = [self._sealer.seal(k, v) for k, v in zip(keys, values, strict=True)]
        self.raw.multi_set(list(keys), sealed)

    def _multi_get(self, keys: Sequence[str]) -> list[bytes]:
        values = self.raw.multi_get(list(keys))
        return [self._open(k, v) for k, v in zip(keys, values, strict=True)]

    def _record_fault_batch(
        self,
        *,
        append: Sequence[tuple[str, str | bytes]],
        set_if_absent: Sequence[tuple[str, str | bytes]],
    ) -> Any:
        return self.raw.record_fault_batch(
            append=[(k, self._sealer.seal(k, v)) for k, v in append],
            set_if_absent=[(k, self._sealer.seal(k, v)) for k, v in set_if_absent],
        )


def seal(store: Any, sealer: Sealer | None) -> Any:
    """``store`` with its values sealed (``sealer`` None: ``store`` itself, unauthenticated)."""
    return store if sealer is None or isinstance(store, SealedStore) else SealedStore(store, sealer)


def unsealed(store: Any) -> Any:
    """The client under a ``SealedStore`` (for torch: process groups, ``ctx.store``)."""
    return store.raw if isinstance(store, SealedStore) else store
