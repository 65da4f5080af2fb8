"""One job's keys on an etcd cluster: where a store key lives and the requests that read, write or
wait for it, each bounded by a deadline (the endpoints' clock). ``EtcdStore``'s way to the cluster.

Keys of a job live under ``restartable/jobs/<prefix>/k/``; the store's own bookkeeping (the write
guard's keys) lives under ``restartable/jobs/<prefix>/`` beside them, so ``delete_all`` of the
job's root removes both in one request.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from restartable.inprocess.etcd import txn as t
from restartable.inprocess.etcd.endpoints import Endpoints
from restartable.inprocess.etcd.watch import Watches

if TYPE_CHECKING:
    from etcd3gw.client import Etcd3Client

ROOT = "restartable/jobs/"


class JobKeys:
    """The keys of job ``prefix`` reached through ``endpoints`` (thread-safe as they are).

    Every request blocks until it is answered or its ``deadline`` (``endpoints.clock``'s
    monotonic seconds) passes; the endpoints fail over between members meanwhile."""

    def __init__(self, endpoints: Endpoints, prefix: str, *, where: str) -> None:
        self.endpoints = endpoints
        self.root = f"{ROOT}{prefix}/"
        self.data = self.root + "k/"
        self._where = where  # the cluster and prefix, for the wait's timeout message
        self.watches = Watches(endpoints)

    def k(self, key: str | bytes) -> bytes:
        """The etcd key of store key ``key``."""
        return self.data.encode() + t.to_bytes(key)

    def call(self, what: str, op: Callable[[Etcd3Client], Any], deadline: float) -> Any:
        return self.endpoints.call(what, op, deadline=deadline)

    def post(self, what: str, path: str, body: dict[str, Any], deadline: float) -> Any:
        """One request to the gateway's ``path`` (``/kv/range``, ``/kv/put``, ...)."""
        return self.call(what, lambda c: c.post(c.get_url(path), json=body), deadline)

    def txn(self, payload: dict[str, Any], deadline: float, what: str) -> dict[str, Any]:
        """One transaction (``inprocess.etcd.txn`` builds ``payload``); its answer."""
        return self.call(what, lambda c: c.transaction(payload), deadline)

    def read(self, key: str, deadline: float) -> bytes | None:
        """The key's value (None when absent): one range request."""
        r = self.post("get", "/kv/range", {"key": t.b64(self.k(key))}, deadline)
        kvs = r.get("kvs") or []
        return t.kv_value(kvs[0]) if kvs else None

    def await_value(self, key: str, deadline: float, bound: float) -> bytes:
        """The key's value once it exists (a read, then one watch: ``Watches``);
        ``EtcdTimeoutError`` after ``deadline`` (``bound``: the timeout, for the message)."""
        what = f"{self._where}: key {key!r} did not appear within the timeout ({bound:.3g} s)"
        return self.watches.await_value(
            self.k(key), lambda d: self.read(key, d), deadline, what=what
        )

    def delete_range(self, what: str, start: str, deadline: float) -> int:
        """Delete every key under ``start``; how many were deleted."""
        begin = start.encode()
        body = {"key": t.b64(begin), "range_end": t.b64(t.prefix_end(begin))}
        return int(self.post(what, "/kv/deleterange", body, deadline).get("deleted", 0))
