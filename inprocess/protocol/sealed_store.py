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
from typing import TYPE_CHECKING

from restartable.checkpoint.sealing import ForgedValueError, Sealer
from restartable.inprocess.protocol.store import Store, StoreBase, as_store

if TYPE_CHECKING:
    import torch.distributed as dist

log = logging.getLogger(__name__)

__all__ = ["ForgedValueError", "SealedStore", "seal", "under_seal", "unsealed"]


class SealedStore(StoreBase):
    """A ``Store`` whose values are sealed with the job's secret (see the module docstring).

    Thread-safe as far as the inner client is. ``raw`` is the inner ``Store`` (``inner`` itself,
    or a ``C10dStore`` around a torch store); ``add``, ``check``, ``wait``, ``delete_key``,
    ``count_arrival``, ``delete_all`` and ``close`` are its own (they carry no value to seal).
    Nothing outside ``Store`` passes through: who needs more of the store under it (a
    server's ``port``) keeps that store.
    """

    def __init__(self, inner: Store | dist.Store, sealer: Sealer) -> None:
        self.raw: Store = as_store(inner)  # a torch store is wrapped (C10dStore)
        self._sealer = sealer
        self._reported: set[str] = set()
        self._lock = threading.Lock()

    def __enter__(self) -> SealedStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SealedStore({self.raw!r})"

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
        equal to its sealed form; ``""`` (absent) stays ``""``. An answer that is byte for byte
        the frame this call sealed (it won, or the key held ``expected``) is not verified again:
        it verifies by construction (one HMAC fewer per compare_set a rank wins)."""
        expected = self._sealer.seal(key, expected_value) if expected_value else b""
        desired = self._sealer.seal(key, desired_value)
        got = self.raw.compare_set(key, expected, desired)
        if got == desired or (expected and got == expected):
            mine = desired_value if got == desired else expected_value
            return mine.encode() if isinstance(mine, str) else bytes(mine)
        return self._open(key, got)

    def try_get(self, key: str) -> bytes | None:
        value = self.raw.try_get(key)
        return None if value is None else self._open(key, value)

    def try_get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        values = self.raw.try_get_many(list(keys))
        return [None if v is None else self._open(k, v) for k, v in zip(keys, values, strict=True)]

    def wait_value(self, key: str, timeout: datetime.timedelta) -> bytes:
        return self._open(key, self.raw.wait_value(key, timeout))

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        if len(keys) != len(values):
            raise ValueError(f"multi_set: {len(keys)} keys but {len(values)} values")
        sealed = [self._sealer.seal(k, v) for k, v in zip(keys, values, strict=True)]
        self.raw.multi_set(list(keys), sealed)

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        values = self.raw.multi_get(list(keys))
        return [self._open(k, v) for k, v in zip(keys, values, strict=True)]

    def record_fault_batch(
        self,
        *,
        append: Sequence[tuple[str, str | bytes]],
        set_if_absent: Sequence[tuple[str, str | bytes]],
    ) -> None:
        self.raw.record_fault_batch(
            append=[(k, self._sealer.seal(k, v)) for k, v in append],
            set_if_absent=[(k, self._sealer.seal(k, v)) for k, v in set_if_absent],
        )

    # ----- no value to seal -----------------------------------------------------------------

    def add(self, key: str, value: int) -> int:
        return self.raw.add(key, value)

    def check(self, keys: Sequence[str]) -> bool:
        return self.raw.check(keys)

    def wait(self, keys: Sequence[str], timeout: datetime.timedelta) -> None:
        self.raw.wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        return self.raw.delete_key(key)

    def count_arrival(self, key: str, member: str | None = None) -> int:
        return self.raw.count_arrival(key, member)

    def delete_all(self) -> int:
        return self.raw.delete_all()

    def close(self) -> None:
        self.raw.close()

    def torch_store(self) -> dist.Store:
        return self.raw.torch_store()


def seal(store: Store | dist.Store, sealer: Sealer | None) -> Store:
    """``store`` (a ``Store`` or a torch store, see ``as_store``) with its values sealed
    (``sealer`` None: as it is, unauthenticated)."""
    if isinstance(store, SealedStore):
        return store
    inner = as_store(store)
    return inner if sealer is None else SealedStore(inner, sealer)


def under_seal(store: Store) -> Store:
    """The ``Store`` under ``store``'s seal (``store`` itself when it is not sealed): what a
    caller seals again with another key (``seal`` leaves a sealed store as it is)."""
    return store.raw if isinstance(store, SealedStore) else store


def unsealed(store: Store | dist.Store) -> dist.Store:
    """The torch store under ``store`` (for torch: process groups, ``ctx.store``); a torch
    store is returned as it is."""
    return as_store(store).torch_store()


if TYPE_CHECKING:

    def _implements_store(store: SealedStore) -> Store:  # mypy checks SealedStore against Store
        return store
