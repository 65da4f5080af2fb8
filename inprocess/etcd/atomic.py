"""The etcd store's read-modify-writes: ``add`` / ``append`` as a compare-and-swap on one key, and
the fault batch (appends plus set-if-absent puts) in one transaction; each applied once even
across a lost answer (``inprocess.etcd.guard``), and retried with what the failed compare read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from restartable.inprocess.etcd import txn as t
from restartable.inprocess.etcd.errors import EtcdTimeoutError
from restartable.inprocess.etcd.guard import WriteGuard
from restartable.inprocess.etcd.keyspace import JobKeys


class AtomicWrites:
    """The non-idempotent writes of one ``EtcdStore`` on ``keys`` (thread-safe: each retry loop
    is the caller's own; the guard numbers the writes under a lock)."""

    def __init__(self, keys: JobKeys) -> None:
        self.keys = keys
        self._guard = WriteGuard(keys.root)

    def update(
        self,
        key: str,
        modify: Callable[[bytes | None], bytes],
        *,
        what: str,
        record: bool,
        deadline: float,
    ) -> bytes:
        """Atomically replace the key's value ``old`` (None: absent) by ``modify(old)``.

        One transaction when the key is absent, else a compare-and-swap on the key's mod
        revision: a failed compare returns the current value in the same round trip, and the
        loop retries with it (contention costs one more). Applied once even across a lost
        answer (``WriteGuard``); ``record``: the guard keeps the new value so that a retry can
        return it (``add``'s result). Returns the value written (``b""`` for a retry that found
        an unrecorded write already applied).
        """
        k = self.keys.k(key)
        mod, old = 0, None  # guess: absent (etcd compares a missing key's mod revision as 0)
        while True:
            body = modify(old)

            def build(seq: int, m: int = mod, body: bytes = body) -> dict[str, Any]:
                success = [t.put(k, body), self._guard.put(seq, body if record else b"")]
                return t.txn([t.unchanged(k, m)], success, [t.read(k)])

            resp, done = self._guard.run(self.keys.endpoints, build, deadline, what)
            if done is not None:
                return done
            assert resp is not None
            if resp.get("succeeded"):
                return body
            kv = t.failure_kv(resp)
            mod, old = t.kv_mod(kv), t.kv_value(kv)
            self._check_contention(what, key, deadline)

    def fault_batch(
        self,
        append: Sequence[tuple[str, str | bytes]],
        set_if_absent: Sequence[tuple[str, str | bytes]],
        *,
        deadline: float,
    ) -> None:
        """``append`` to each key and set each ``set_if_absent`` key unless present: ONE
        transaction (one round trip when the appended keys did not change under this client).

        The appends are a compare-and-swap on every appended key's mod revision, retried with
        the values the failure branch read (as ``update``); the set-if-absent puts are nested
        transactions, each with its own condition, so a key that is already set (an earlier
        fault) does not fail the others. Keys must be distinct.
        """
        batch = _FaultBatch(
            [self.keys.k(k) for k, _ in append],
            [t.to_bytes(v) for _, v in append],
            [t.set_if_absent(self.keys.k(k), t.to_bytes(v)) for k, v in set_if_absent],
        )
        while True:
            resp, done = self._guard.run(
                self.keys.endpoints,
                lambda seq: batch.payload(self._guard.put(seq, b"")),
                deadline,
                "record_fault",
            )
            if done is not None or (resp is not None and resp.get("succeeded")):
                return
            assert resp is not None
            batch.retry_with(resp)
            self._check_contention("record_fault", "the fault keys", deadline)

    def _check_contention(self, what: str, key: str, deadline: float) -> None:
        if self.keys.endpoints.clock.monotonic() > deadline:
            raise EtcdTimeoutError(
                f"etcd {what}({key!r}): the key kept changing under this client until the "
                "timeout: raise the store timeout"
            )


class _FaultBatch:
    """The transaction of one ``fault_batch``: a compare-and-swap of every appended key
    (``keys``, ``tails``) plus the nested set-if-absent transactions, retried with the values
    the failure branch read."""

    def __init__(self, keys: list[bytes], tails: list[bytes], nested: list[dict[str, Any]]):
        self.keys, self.tails, self.nested = keys, tails, nested
        self.mods = [0] * len(keys)  # guess: absent (a missing key's mod revision is 0)
        self.olds: list[bytes] = [b""] * len(keys)

    def payload(self, guard_put: dict[str, Any]) -> dict[str, Any]:
        compares = [t.unchanged(k, m) for k, m in zip(self.keys, self.mods, strict=True)]
        puts = [
            t.put(k, old + tail)
            for k, old, tail in zip(self.keys, self.olds, self.tails, strict=True)
        ]
        return t.txn(compares, [*puts, *self.nested, guard_put], [t.read(k) for k in self.keys])

    def retry_with(self, resp: dict[str, Any]) -> None:
        """Take the current values of the appended keys from a failed attempt's answer."""
        responses = resp.get("responses") or []
        kvs = [t.range_kv(responses[i]) for i in range(len(self.keys))]
        self.mods = [t.kv_mod(kv) for kv in kvs]
        self.olds = [t.kv_value(kv) or b"" for kv in kvs]
