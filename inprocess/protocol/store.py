"""The coordination store as the protocol sees it: ``Store``, every operation the framework calls,
and ``StoreBase``, the generic form of the fast paths for a c10d store (the TCPStore).

Three backends implement ``Store``: ``C10dStore`` (any ``torch.distributed.Store``, the TCPStore
above all, wrapped), the watchdog's torch-free ``inprocess.protocol.tcpstore_client
.TCPStoreClient`` and ``inprocess.etcd.EtcdStore``; ``inprocess.protocol.sealed_store
.SealedStore`` wraps any of them. tests/unit/test_store_conformance.py runs one suite against
each. Nothing else is read from a store: no attribute passes through a wrapper. The fast paths
(``try_get``, ``try_get_many``, ``wait_value``, ``count_arrival``, ``record_fault_batch``,
``multi_set``) are declared here with their contract, so the protocol
(``inprocess.protocol.keys``) calls them unconditionally: ``StoreBase`` writes each one with
the c10d operations, in as many round trips as the protocol made before it had them; etcd does
each in one transaction. No torch import at run time (``inprocess.protocol`` is torch-free;
torch's ``Store`` is named for the type checker only).
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, cast

if TYPE_CHECKING:
    import torch.distributed as dist


class Store(Protocol):
    """What the framework's processes call on the coordination store (``as_store`` makes one).

    c10d semantics: ``get`` and ``wait`` block until their keys exist (at most the store's
    timeout, then a timeout error: ``DistStoreError`` / ``EtcdTimeoutError``, both with
    "timeout" in their message); ``add`` is an atomic counter; ``compare_set`` with an empty
    expected value means "set if absent" and returns the value now stored (``expected`` when
    the key is absent and ``expected`` is not empty). Every method may be called from several
    threads as far as the backend's client allows (EtcdStore: yes; a TCPStore client: one call
    at a time, so each thread that blocks opens its own client).
    """

    def set(self, key: str, value: str | bytes) -> None: ...
    def get(self, key: str) -> bytes: ...
    def add(self, key: str, value: int) -> int: ...
    def append(self, key: str, value: str | bytes) -> None: ...
    def compare_set(
        self, key: str, expected_value: str | bytes, desired_value: str | bytes
    ) -> bytes: ...
    def check(self, keys: Sequence[str]) -> bool: ...
    def wait(self, keys: Sequence[str], timeout: datetime.timedelta) -> None: ...
    def delete_key(self, key: str) -> bool: ...
    def multi_get(self, keys: Sequence[str]) -> list[bytes]: ...
    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        """Put several keys (one round trip on the TCPStore, one transaction on etcd)."""

    # ----- fast paths: one round trip on etcd, the generic form on a c10d store ------------

    def try_get(self, key: str) -> bytes | None:
        """The key's value, or None when absent; never blocks, never writes."""

    def try_get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """``try_get`` of each key (etcd: one consistent snapshot); never blocks."""

    def wait_value(self, key: str, timeout: datetime.timedelta) -> bytes:
        """``wait([key], timeout)`` then ``get(key)``: the key's value once it exists."""

    def count_arrival(self, key: str, member: str | None = None) -> int:
        """Count one arrival at counter ``key``; return how many arrivals are counted.

        ``member`` None: a new arrival that is never repeated (TCPStore: one ``add``).
        ``member`` given: counted once however often it is repeated (a lost answer, a death
        reported twice); a repeat counts nothing and returns the current count."""

    def record_fault_batch(
        self,
        *,
        append: Sequence[tuple[str, str | bytes]],
        set_if_absent: Sequence[tuple[str, str | bytes]],
    ) -> None:
        """``append`` to each key, then set each ``set_if_absent`` key unless present (etcd:
        one transaction). Keys must be distinct."""

    def delete_all(self) -> int:
        """Delete every key of the job (the last rank out of a job on etcd); returns how many.
        Only etcd has it: a TCPStore's keys go with its server (``NotImplementedError``)."""

    def close(self) -> None:
        """Release the client's connections (idempotent); the keys stay."""

    def torch_store(self) -> dist.Store:
        """The ``torch.distributed.Store`` under this one, unsealed (for process groups and
        ``ctx.store``, whose values are torch's own). The watchdog's torch-free client has none
        (``TypeError``)."""


class StoreBase:
    """The fast paths of ``Store`` written with its c10d operations (``set``, ``get``, ``add``,
    ``append``, ``compare_set``, ``check``, ``wait``, which a subclass provides). Each costs what
    the protocol paid before the fast paths were declared; a backend with a cheaper way
    (``EtcdStore``) overrides them. The one place of the protocol's operations above the c10d
    ones: a backend overrides one only as a documented fast path with the same contract (the
    conformance suite checks both forms). Also the mark of a ``Store`` for ``as_store``."""

    def try_get(self: Store, key: str) -> bytes | None:
        # Not a compare_set with an impossible expected value: on a TCPStore that wakes every
        # client waiting on the key (measured: a monitor woke with an empty outcome).
        return bytes(self.get(key)) if self.check([key]) else None

    def try_get_many(self: Store, keys: Sequence[str]) -> list[bytes | None]:
        return [self.try_get(k) for k in keys]

    def wait_value(self: Store, key: str, timeout: datetime.timedelta) -> bytes:
        self.wait([key], timeout)
        return bytes(self.get(key))

    def count_arrival(self: Store, key: str, member: str | None = None) -> int:
        if member is None:
            return int(self.add(key, 1))
        if int(self.add(f"{key}/{member}", 1)) != 1:
            return int(self.add(key, 0))  # counted before: read the count, count nothing
        return int(self.add(key, 1))

    def record_fault_batch(
        self: Store,
        *,
        append: Sequence[tuple[str, str | bytes]],
        set_if_absent: Sequence[tuple[str, str | bytes]],
    ) -> None:
        for k, v in append:
            self.append(k, v)
        for k, v in set_if_absent:
            self.compare_set(k, "", v)

    def multi_get(self: Store, keys: Sequence[str]) -> list[bytes]:
        return [bytes(self.get(k)) for k in keys]

    def multi_set(self: Store, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        if len(keys) != len(values):
            raise ValueError(f"multi_set: {len(keys)} keys but {len(values)} values")
        for k, v in zip(keys, values, strict=True):
            self.set(k, v)

    def delete_all(self) -> int:
        raise NotImplementedError(
            f"{type(self).__name__} cannot delete a job's keys: they go with the store's server"
        )

    def close(self) -> None:
        """Nothing to release by default."""


class C10dStore(StoreBase):
    """A ``torch.distributed.Store`` (TCPStore, PrefixStore, ...) as a ``Store``: every c10d
    operation forwarded as it is, the fast paths in their generic form (``StoreBase``) except
    ``multi_get`` / ``multi_set``, which c10d stores do in one round trip.

    Nothing else of the torch store passes through: who needs more (a server's ``port``) keeps
    the torch store it wrapped. ``close()`` drops nothing: a TCPStore client closes when it is
    dropped."""

    def __init__(self, inner: dist.Store) -> None:
        self.inner = inner

    def set(self, key: str, value: str | bytes) -> None:
        self.inner.set(key, value)  # type: ignore[arg-type]  # torch's stub: str; bytes work

    def get(self, key: str) -> bytes:
        return bytes(self.inner.get(key))

    def add(self, key: str, value: int) -> int:
        return int(self.inner.add(key, value))

    def append(self, key: str, value: str | bytes) -> None:
        self.inner.append(key, value)  # type: ignore[attr-defined]  # missing from torch's stub

    def compare_set(
        self, key: str, expected_value: str | bytes, desired_value: str | bytes
    ) -> bytes:
        got = self.inner.compare_set(key, expected_value, desired_value)  # type: ignore[arg-type]
        return bytes(got)  # (torch's stub names str values only; bytes work, as for set)

    def check(self, keys: Sequence[str]) -> bool:
        return bool(self.inner.check(list(keys)))

    def wait(self, keys: Sequence[str], timeout: datetime.timedelta) -> None:
        self.inner.wait(list(keys), timeout)

    def delete_key(self, key: str) -> bool:
        return bool(self.inner.delete_key(key))

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        return [bytes(v) for v in self.inner.multi_get(list(keys))]

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        if len(keys) != len(values):
            raise ValueError(f"multi_set: {len(keys)} keys but {len(values)} values")
        self.inner.multi_set(list(keys), list(values))  # type: ignore[attr-defined]  # as append

    def torch_store(self) -> dist.Store:
        return self.inner

    def __repr__(self) -> str:
        return f"C10dStore({self.inner!r})"


def as_store(store: Store | dist.Store) -> Store:
    """``store`` as a ``Store``: itself when it is one (a ``StoreBase``: ``C10dStore``,
    ``EtcdStore``, ``SealedStore``, a test's fake store), else a ``C10dStore`` around it (a
    torch store). Called where a client is opened (``sealed_store.seal``), never per call."""
    if isinstance(store, StoreBase):
        return cast(Store, store)
    return C10dStore(cast("dist.Store", store))


if TYPE_CHECKING:

    def _implements_store(store: C10dStore) -> Store:  # mypy checks C10dStore against Store
        return store
