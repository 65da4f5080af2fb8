"""``EtcdStore``: a ``torch.distributed.Store`` whose keys live in an etcd v3 cluster.

Semantics follow c10d's ``TCPStore``: ``get`` and ``wait`` block until their keys exist (at most
the store's ``timeout``), ``add`` is an atomic counter, ``compare_set`` with an empty expected
value means "set if absent". A wait reads the key; when it is missing, it opens a watch and reads
the key again once etcd confirmed the watch, so no write between the two is missed; the watch
stays open while it is healthy, across waits of the same key (``inprocess.etcd.watch``). It
implements ``inprocess.protocol.store.Store``, the fast paths in one transaction each. The job's
keys and requests are ``inprocess.etcd.keyspace``'s, the read-modify-writes
``inprocess.etcd.atomic``'s.

Keys of a job live under ``restartable/jobs/<prefix>/k/``: a new job with another prefix never
sees a key of an earlier one, and ``delete_all()`` removes a finished job's keys in one request.
"""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch.distributed as dist

from restartable.checkpoint.store_delete import is_delete
from restartable.inprocess.clock import SYSTEM, Clock
from restartable.inprocess.errors import ConfigError
from restartable.inprocess.etcd import txn as t
from restartable.inprocess.etcd.atomic import AtomicWrites
from restartable.inprocess.etcd.endpoints import Endpoints
from restartable.inprocess.etcd.keyspace import JobKeys
from restartable.inprocess.etcd.url import EtcdAddress, check_prefix, parse_url
from restartable.inprocess.protocol.store import Store, StoreBase

DEFAULT_TIMEOUT_S = 300.0  # c10d's default store timeout
# One request's bound before the next endpoint is tried. A follower that lost its leader holds a
# write until a new leader is elected or this passes; a request itself takes milliseconds.
# Retrying early is safe (writes are guarded, see inprocess.etcd.guard).
DEFAULT_REQUEST_TIMEOUT_S = 1.0


class EtcdStore(StoreBase, dist.Store):
    """A c10d store on an etcd v3 cluster (every member of ``url`` tried; see the module doc).

    ``url``: ``etcd://host:port[,host:port...][/prefix]`` (``etcds://`` for TLS; credentials
    from ``credentials`` or the environment, see ``inprocess.etcd.security``). ``prefix``: the
    job's namespace (a job id); required here or in the URL. ``timeout``: bound of the blocking
    ``get``, ``wait`` and ``wait_value`` (c10d's ``set_timeout`` changes it);
    ``connect_timeout`` (default: ``timeout``): bound of connecting and of every other call (a
    client that waits in short slices, the launcher's relay, still writes through a member that
    is slow under load or hung). ``request_timeout``: bound of one HTTP request before the next
    endpoint is tried. ``clock``: where deadlines and backoffs take their time. Connecting
    checks (one request) that some endpoint is an etcd with the v3 API; raises ``ConfigError``
    for a bad URL or prefix, ``EtcdTimeoutError`` when no endpoint answers within
    ``connect_timeout``, ``EtcdStoreError`` when one answers without the v3 API. Safe to use
    from several threads; ``close()`` releases the HTTP connections and ends the watches.
    """

    def __init__(
        self,
        url: str,
        *,
        prefix: str | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        request_timeout: float = DEFAULT_REQUEST_TIMEOUT_S,
        connect_timeout: float | None = None,
        clock: Clock = SYSTEM,
    ) -> None:
        super().__init__()
        address = parse_url(url)
        self.prefix = _job_prefix(url, prefix if prefix is not None else address.prefix)
        bounds = [("timeout", timeout), ("request_timeout", request_timeout)]
        for name, value in [*bounds, ("connect_timeout", connect_timeout or timeout)]:
            if not value > 0:
                raise ConfigError(
                    f"EtcdStore {name} ({value}) must be > 0 seconds: pass a positive duration"
                )
        self.address = EtcdAddress(address.endpoints, self.prefix, tls=address.tls)
        self._clock = clock
        self._endpoints = Endpoints(
            address, request_timeout=min(request_timeout, timeout), clock=clock
        )
        where = f"{self.address.describe()} (prefix {self.prefix!r})"
        self._keys = JobKeys(self._endpoints, self.prefix, where=where)
        self._atomic = AtomicWrites(self._keys)  # non-idempotent writes (add, append, batch)
        self.set_timeout(datetime.timedelta(seconds=timeout))
        self._call_bound = connect_timeout
        self._endpoints.probe(deadline=self._deadline())

    def _deadline(self) -> float:
        """The deadline of a call that does not wait for a key."""
        bound = self._bound() if self._call_bound is None else self._call_bound
        return self._clock.monotonic() + bound

    def _wait_deadline(self, timeout: datetime.timedelta | None = None) -> float:
        return self._clock.monotonic() + self._bound(timeout)

    def _bound(self, timeout: datetime.timedelta | None = None) -> float:
        t_ = self.timeout if timeout is None else timeout  # type: ignore[attr-defined]
        return float(t_.total_seconds())

    # ----- c10d Store API ----------------------------------------------------------------------

    def set(self, key: str, value: str | bytes) -> None:
        """Put ``value``; ``checkpoint.store_delete.DELETE_VALUE`` deletes the key instead (the
        delete that torch's C++ wrappers of this store cannot pass on)."""
        if is_delete(value):
            self.delete_key(key)
            return
        body = {"key": t.b64(self._keys.k(key)), "value": t.b64(t.to_bytes(value))}
        self._keys.post("set", "/kv/put", body, self._deadline())

    def get(self, key: str) -> bytes:
        """The key's value; blocks until it exists (at most the store's timeout)."""
        return self._keys.await_value(key, self._wait_deadline(), self._bound())

    def add(self, key: str, value: int) -> int:
        """Add ``value`` to the integer at ``key`` (0 when absent); return the new value."""
        n = int(value)
        new = self._atomic.update(
            key,
            lambda old: str(int(old or b"0") + n).encode(),
            what="add",
            record=True,
            deadline=self._deadline(),
        )
        return int(new)

    def append(self, key: str, value: str | bytes) -> None:
        """Append ``value`` to the key's bytes (creating it); atomic, like ``add``."""
        tail = t.to_bytes(value)
        self._atomic.update(
            key,
            lambda old: (old or b"") + tail,
            what="append",
            record=False,
            deadline=self._deadline(),
        )

    def compare_set(
        self, key: str, expected_value: str | bytes, desired_value: str | bytes
    ) -> bytes:
        """c10d semantics: set ``desired`` when the current value equals ``expected`` (an empty
        ``expected`` matches an absent key) and return it; otherwise return the current value
        (``expected`` when the key is absent). Repeating it after a lost answer is harmless."""
        k = self._keys.k(key)
        expected, desired = t.to_bytes(expected_value), t.to_bytes(desired_value)
        compare = t.equals(k, expected) if expected else t.absent(k)
        payload = t.txn([compare], [t.put(k, desired)], [t.read(k)])
        resp = self._keys.txn(payload, self._deadline(), "compare_set")
        if resp.get("succeeded"):
            return desired
        current = t.kv_value(t.failure_kv(resp))
        if current is None:
            return expected
        if not expected and current == b"":  # present but empty matches "" too (TCPStore)
            self.set(key, desired)
            return desired
        return current

    def check(self, keys: Sequence[str]) -> bool:
        """True when every key exists (one request, never blocks on absent keys)."""
        if not keys:
            return True
        payload = t.txn([], [t.read(self._keys.k(k), count_only=True) for k in keys])
        resp = self._keys.txn(payload, self._deadline(), "check")
        return all(
            int(r.get("response_range", {}).get("count", 0)) > 0 for r in resp.get("responses", [])
        )

    def wait(self, keys: Sequence[str], timeout: datetime.timedelta | None = None) -> None:
        """Block until every key exists; ``EtcdTimeoutError`` after ``timeout`` (default: the
        store's timeout)."""
        deadline, bound = self._wait_deadline(timeout), self._bound(timeout)
        for key in keys:
            self._keys.await_value(key, deadline, bound)

    def delete_key(self, key: str) -> bool:
        body = {"key": t.b64(self._keys.k(key))}
        r = self._keys.post("delete_key", "/kv/deleterange", body, self._deadline())
        return int(r.get("deleted", 0)) > 0

    def num_keys(self) -> int:
        """How many keys this job holds (not counting the store's own bookkeeping)."""
        start = self._keys.data.encode()
        body = {"key": t.b64(start), "range_end": t.b64(t.prefix_end(start)), "count_only": True}
        answer = self._keys.post("num_keys", "/kv/range", body, self._deadline())
        return int(answer.get("count", 0))

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        """Put several keys in ONE transaction (c10d's ``multi_set``; the facts every rank
        publishes at the start of an iteration). ``DELETE_VALUE`` is not special here."""
        if len(keys) != len(values):
            raise ValueError(f"multi_set: {len(keys)} keys but {len(values)} values")
        puts = [t.put(self._keys.k(k), t.to_bytes(v)) for k, v in zip(keys, values, strict=True)]
        self._keys.txn(t.txn([], puts), self._deadline(), "multi_set")

    # ----- the protocol's fast paths (inprocess.protocol.store.Store) --------------------------

    def record_fault_batch(
        self,
        *,
        append: Sequence[tuple[str, str | bytes]],
        set_if_absent: Sequence[tuple[str, str | bytes]],
    ) -> None:
        """``append`` to each key and set each ``set_if_absent`` key unless present: ONE
        transaction (``AtomicWrites.fault_batch``), applied once even across a lost answer.

        ``protocol.fault_records.record_fault`` uses it: a fault's record, the gone list and
        the iteration's three release keys, which on etcd were five sequential requests
        (docs/scale.md). Keys must be distinct.
        """
        self._atomic.fault_batch(append, set_if_absent, deadline=self._deadline())

    def count_arrival(self, key: str, member: str | None = None) -> int:
        """Count ``member`` once under ``key`` and return how many members are counted: ONE
        transaction, without contention (``member`` None: a fresh one, never repeated).

        ``inprocess.protocol.barriers`` use it instead of ``add``: on etcd an ``add`` is
        a compare-and-swap on one counter, two round trips on an existing key and one more per
        concurrent writer, so N ranks arriving together cost O(N^2) requests. Here each member
        puts its own key ``<key>/<member>`` (if absent) and the same transaction counts the keys
        under ``<key>/`` (a count-only range). Repeating it (a lost answer) counts nothing
        twice.
        """
        base = self._keys.k(key) + b"/"
        mine = base + (uuid.uuid4().hex if member is None else member).encode()
        count = t.count_prefix(base)
        payload = t.txn([t.absent(mine)], [t.put(mine, b"1"), count], [count])
        resp = self._keys.txn(payload, self._deadline(), "count_arrival")
        return int(resp["responses"][-1].get("response_range", {}).get("count", 0))

    def try_get(self, key: str) -> bytes | None:
        """The key's value, or None when it is absent: one range request, never blocks."""
        return self._keys.read(key, self._deadline())

    def try_get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """``try_get`` of several keys in ONE transaction (a consistent snapshot; the restart
        decision's inputs in one round trip); never blocks."""
        if not keys:
            return []
        payload = t.txn([], [t.read(self._keys.k(k)) for k in keys])
        resp = self._keys.txn(payload, self._deadline(), "try_get_many")
        return [t.kv_value(t.range_kv(r)) for r in resp.get("responses", [])]

    def wait_value(self, key: str, timeout: datetime.timedelta) -> bytes:
        """``wait([key], timeout)`` then ``get(key)`` in one step: the read that finds the key,
        or the watch event that reports its put, carries the value (one round trip fewer per
        released waiter)."""
        return self._keys.await_value(key, self._wait_deadline(timeout), timeout.total_seconds())

    # ----- the job's lifetime ------------------------------------------------------------------

    def delete_all(self) -> int:
        """Delete every key of this job (the end of a job; any rank may call it once all have
        left). Returns how many keys were deleted. Other jobs' keys are untouched."""
        return self._keys.delete_range("delete_all", self._keys.root, self._deadline())

    def close(self) -> None:
        """Release the HTTP connections and end the watches (idempotent); the keys stay (see
        ``delete_all``)."""
        self._keys.watches.close()
        self._endpoints.close()

    def torch_store(self) -> EtcdStore:
        return self

    def __enter__(self) -> EtcdStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"EtcdStore({self.address.describe()!r}, prefix={self.prefix!r})"


def _job_prefix(url: str, prefix: str | None) -> str:
    if not prefix:
        raise ConfigError(
            f"EtcdStore({url!r}) has no job prefix: pass prefix= (for example the job id) "
            "or end the URL with /<job-id>; it keeps this job's keys apart from others'"
        )
    return check_prefix(prefix, where="EtcdStore prefix")


if TYPE_CHECKING:

    def _implements_store(store: EtcdStore) -> Store:  # mypy checks EtcdStore against Store
        return store
