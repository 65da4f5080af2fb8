"""``EtcdStore``: a ``torch.distributed.Store`` whose keys live in an etcd v3 cluster.

Semantics follow c10d's ``TCPStore``: ``get`` and ``wait`` block until their keys exist (at most
the store's ``timeout``), ``add`` is an atomic counter, ``compare_set`` with an empty expected
value means "set if absent". A wait reads the key; when it is missing, it opens a watch and reads
the key again once etcd confirmed the watch, so no write between the two is missed.

Keys of a job live under ``restartable/jobs/<prefix>/k/``: a new job with another prefix never
sees a key of an earlier one, and ``delete_all()`` removes a finished job's keys in one request.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import itertools
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from checkpoint.exchange import DELETE_VALUE
from inprocess.errors import ConfigError
from inprocess.etcd.endpoints import Endpoints, Transient, classify
from inprocess.etcd.errors import EtcdTimeoutError
from inprocess.etcd.url import EtcdAddress, check_prefix, parse_url

if TYPE_CHECKING:
    from etcd3gw.client import Etcd3Client

log = logging.getLogger(__name__)

ROOT = "restartable/jobs/"
# A watch is re-armed this often while a wait goes on: a watch whose member died ends silently
# in etcd3gw, so this bounds the stall a lost member adds to a waiter (the issue's "short
# stall"), at the cost of one range + one watch request per waiter per period.
_WATCH_SLICE_S = 1.0
DEFAULT_TIMEOUT_S = 300.0  # c10d's default store timeout
# One request's bound before the next endpoint is tried. A follower that lost its leader holds a
# write until a new leader is elected or this passes; a request itself takes milliseconds.
# Retrying early is safe (writes are guarded, see _guarded_txn).
DEFAULT_REQUEST_TIMEOUT_S = 1.0


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class EtcdStore(dist.Store):
    """A c10d store on an etcd v3 cluster (every member of ``url`` tried; see the module doc).

    ``url``: ``etcd://host:port[,host:port...][/prefix]``. ``prefix``: the job's namespace (a
    job id); required here or in the URL. ``timeout``: bound of every call, blocking ``get`` and
    ``wait`` included (c10d's ``set_timeout`` changes it). ``request_timeout``: bound of one
    HTTP request before the next endpoint is tried. Connecting checks (one request) that some
    endpoint is an etcd with the v3 API; raises ``ConfigError`` for a bad URL or prefix,
    ``EtcdTimeoutError`` when no endpoint answers within ``timeout``, ``EtcdStoreError`` when
    one answers without the v3 API. Safe to use from several threads; ``close()`` releases the
    HTTP connections.
    """

    def __init__(
        self,
        url: str,
        *,
        prefix: str | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        request_timeout: float = DEFAULT_REQUEST_TIMEOUT_S,
        connect_timeout: float | None = None,
    ) -> None:
        super().__init__()
        address = parse_url(url)
        prefix = prefix if prefix is not None else address.prefix
        if not prefix:
            raise ConfigError(
                f"EtcdStore({url!r}) has no job prefix: pass prefix= (for example the job id) "
                "or end the URL with /<job-id>; it keeps this job's keys apart from others'"
            )
        checked = check_prefix(prefix, where="EtcdStore prefix")
        for name, value in (("timeout", timeout), ("request_timeout", request_timeout)):
            if not value > 0:
                raise ConfigError(
                    f"EtcdStore {name} ({value}) must be > 0 seconds: pass a positive duration"
                )
        self.address = EtcdAddress(address.endpoints, checked)
        self.prefix = checked
        self._root = f"{ROOT}{checked}/"
        self._data = self._root + "k/"
        self._endpoints = Endpoints(address, request_timeout=min(request_timeout, timeout))
        self.set_timeout(datetime.timedelta(seconds=timeout))
        # Guard of non-idempotent writes (add, append): see _guarded_txn.
        self._guard_key = f"{self._root}ops/{uuid.uuid4().hex}"
        self._seq = itertools.count(1)
        self._seq_lock = threading.Lock()
        bound = timeout if connect_timeout is None else connect_timeout
        self._endpoints.probe(deadline=time.monotonic() + bound)

    # ----- plumbing ----------------------------------------------------------------------------

    def _deadline(self, timeout: datetime.timedelta | None = None) -> float:
        t = self.timeout if timeout is None else timeout  # type: ignore[attr-defined]
        return time.monotonic() + t.total_seconds()

    def _k(self, key: str | bytes) -> bytes:
        return self._data.encode() + _bytes(key)

    def _call(self, what: str, op: Callable[[Etcd3Client], Any], deadline: float) -> Any:
        return self._endpoints.call(what, op, deadline=deadline)

    def _txn(self, payload: dict[str, Any], deadline: float, what: str) -> dict[str, Any]:
        return self._call(what, lambda c: c.transaction(payload), deadline)

    def _read(self, key: str, deadline: float) -> bytes | None:
        """The key's value (None when absent): one range request, through the endpoints'
        bounded fail-over."""
        k = _b64(self._k(key))
        r = self._call("get", lambda c: c.post(c.get_url("/kv/range"), json={"key": k}), deadline)
        kvs = r.get("kvs") or []
        return base64.b64decode(kvs[0].get("value", "")) if kvs else None

    def _next_seq(self) -> int:
        with self._seq_lock:
            return next(self._seq)

    def _guarded_txn(
        self, build: Callable[[int], dict[str, Any]], deadline: float, what: str
    ) -> tuple[dict[str, Any] | None, bytes | None]:
        """Run the transaction ``build(seq)`` once, even across a lost response.

        ``build`` adds to its success branch a put of this client's guard key with value
        ``"<seq>:<result>"``. If a request fails after etcd may have committed it (the member
        died before answering, or committed it after this client's request timeout), the guard
        tells whether it did: then this returns ``(None, result)`` instead of applying the write
        twice (a counter of a barrier counted twice would release it early). Otherwise returns
        ``(response, None)``; the first failure response is the caller's own read.
        """
        seq = self._next_seq()
        payload = build(seq)
        guard = _b64(self._guard_key.encode())
        # The failure branch also reads the guard: an earlier attempt that etcd committed late
        # (after this client gave up on it) makes the compare fail, and must not be taken for
        # another writer's change.
        payload["failure"] = [*payload["failure"], {"request_range": {"key": guard}}]
        tag = f"{seq}:".encode()
        attempts = 0

        def applied(kvs: list[dict[str, Any]] | None) -> bytes | None:
            value = base64.b64decode(kvs[0].get("value", "")) if kvs else b""
            return value[len(tag) :] if value.startswith(tag) else None

        def attempt(c: Etcd3Client) -> tuple[dict[str, Any] | None, bytes | None]:
            nonlocal attempts
            attempts += 1
            if attempts > 1:  # an earlier attempt failed, maybe after etcd committed it
                r = c.post(c.get_url("/kv/range"), json={"key": guard})
                done = applied(r.get("kvs"))
                if done is not None:
                    return None, done
            resp: dict[str, Any] = dict(c.transaction(payload))
            if not resp.get("succeeded"):
                responses: list[dict[str, Any]] = resp.get("responses") or []
                last = responses[-1].get("response_range", {}) if responses else {}
                done = applied(last.get("kvs"))
                if done is not None:
                    return None, done
            return resp, None

        return self._call(what, attempt, deadline)

    def _guard_put(self, seq: int, result: bytes) -> dict[str, Any]:
        return {
            "request_put": {
                "key": _b64(self._guard_key.encode()),
                "value": _b64(f"{seq}:".encode() + result),
            }
        }

    # ----- c10d Store API ----------------------------------------------------------------------

    def set(self, key: str, value: str | bytes) -> None:
        """Put ``value``; ``checkpoint.exchange.DELETE_VALUE`` deletes the key instead (the
        delete that torch's C++ wrappers of this store cannot pass on)."""
        if value == DELETE_VALUE:
            self.delete_key(key)
            return
        k, v = _b64(self._k(key)), _b64(_bytes(value))
        self._call(
            "set",
            lambda c: c.post(c.get_url("/kv/put"), json={"key": k, "value": v}),
            self._deadline(),
        )

    def get(self, key: str) -> bytes:
        """The key's value; blocks until it exists (at most the store's timeout)."""
        return self._await(key, self._deadline(), self.timeout.total_seconds())  # type: ignore[attr-defined]

    def add(self, key: str, value: int) -> int:
        """Add ``value`` to the integer at ``key`` (0 when absent); return the new value."""
        n = int(value)
        return int(self._update(key, lambda old: str(int(old or b"0") + n).encode(), "add", True))

    def append(self, key: str, value: str | bytes) -> None:
        """Append ``value`` to the key's bytes (creating it); atomic, like ``add``."""
        tail = _bytes(value)
        self._update(key, lambda old: (old or b"") + tail, "append", False)

    def _update(
        self, key: str, modify: Callable[[bytes | None], bytes], what: str, record: bool
    ) -> bytes:
        """Atomically replace the key's value ``old`` (None: absent) by ``modify(old)``.

        One transaction when the key is absent, else a compare-and-swap on the key's mod
        revision: a failed compare returns the current value in the same round trip, and the
        loop retries with it (contention costs one more). Applied once even across a lost
        answer (``_guarded_txn``); ``record``: the guard keeps the new value so that a retry can
        return it (``add``'s result). Returns the value written (``b""`` for a retry that found
        an unrecorded write already applied).
        """
        k = _b64(self._k(key))
        deadline = self._deadline()
        mod, old = 0, None  # guess: absent (etcd compares a missing key's mod revision as 0)
        while True:
            body = modify(old)

            def build(seq: int, m: int = mod, body: bytes = body) -> dict[str, Any]:
                return {
                    "compare": [{"key": k, "result": "EQUAL", "target": "MOD", "mod_revision": m}],
                    "success": [
                        {"request_put": {"key": k, "value": _b64(body)}},
                        self._guard_put(seq, body if record else b""),
                    ],
                    "failure": [{"request_range": {"key": k}}],
                }

            resp, done = self._guarded_txn(build, deadline, what)
            if done is not None:
                return done
            assert resp is not None
            if resp.get("succeeded"):
                return body
            kv = _failure_kv(resp)
            mod = int(kv["mod_revision"]) if kv else 0
            old = base64.b64decode(kv.get("value", "")) if kv else None
            if time.monotonic() > deadline:
                raise EtcdTimeoutError(
                    f"etcd {what}({key!r}): the key kept changing under this client until the "
                    "timeout: raise the store timeout"
                )

    def compare_set(
        self, key: str, expected_value: str | bytes, desired_value: str | bytes
    ) -> bytes:
        """c10d semantics: set ``desired`` when the current value equals ``expected`` (an empty
        ``expected`` matches an absent key) and return it; otherwise return the current value
        (``expected`` when the key is absent). Repeating it after a lost answer is harmless."""
        k = self._k(key)
        expected, desired = _bytes(expected_value), _bytes(desired_value)
        if expected:
            compare: dict[str, Any] = {
                "key": _b64(k),
                "result": "EQUAL",
                "target": "VALUE",
                "value": _b64(expected),
            }
        else:
            compare = {"key": _b64(k), "result": "EQUAL", "target": "CREATE", "create_revision": 0}
        payload = {
            "compare": [compare],
            "success": [{"request_put": {"key": _b64(k), "value": _b64(desired)}}],
            "failure": [{"request_range": {"key": _b64(k)}}],
        }
        resp = self._txn(payload, self._deadline(), "compare_set")
        if resp.get("succeeded"):
            return desired
        kv = _failure_kv(resp)
        if kv is None:
            return expected
        current = base64.b64decode(kv.get("value", ""))
        if not expected and current == b"":  # present but empty matches "" too (TCPStore)
            self.set(key, desired)
            return desired
        return current

    def check(self, keys: Sequence[str]) -> bool:
        """True when every key exists (one request, never blocks on absent keys)."""
        if not keys:
            return True
        payload = {
            "compare": [],
            "success": [
                {"request_range": {"key": _b64(self._k(k)), "count_only": True}} for k in keys
            ],
            "failure": [],
        }
        resp = self._txn(payload, self._deadline(), "check")
        return all(
            int(r.get("response_range", {}).get("count", 0)) > 0 for r in resp.get("responses", [])
        )

    def wait(self, keys: Sequence[str], timeout: datetime.timedelta | None = None) -> None:
        """Block until every key exists; ``EtcdTimeoutError`` after ``timeout`` (default: the
        store's timeout)."""
        deadline = self._deadline(timeout)
        bound = (self.timeout if timeout is None else timeout).total_seconds()  # type: ignore[attr-defined]
        for key in keys:
            self._await(key, deadline, bound)

    def delete_key(self, key: str) -> bool:
        k = _b64(self._k(key))
        r = self._call(
            "delete_key",
            lambda c: c.post(c.get_url("/kv/deleterange"), json={"key": k}),
            self._deadline(),
        )
        return int(r.get("deleted", 0)) > 0

    def num_keys(self) -> int:
        """How many keys this job holds (not counting the store's own bookkeeping)."""
        start = self._data.encode()
        payload = {"key": _b64(start), "range_end": _b64(_prefix_end(start)), "count_only": True}
        r = self._call(
            "num_keys", lambda c: c.post(c.get_url("/kv/range"), json=payload), self._deadline()
        )
        return int(r.get("count", 0))

    # ----- beyond c10d -------------------------------------------------------------------------

    def record_fault_batch(
        self,
        *,
        append: Sequence[tuple[str, str | bytes]],
        set_if_absent: Sequence[tuple[str, str | bytes]],
    ) -> None:
        """``append`` to each key and set each ``set_if_absent`` key unless present: ONE
        transaction (one round trip when the appended keys did not change under this client).

        ``inprocess.protocol.keys.record_fault`` uses it (found through ``getattr``): a fault's
        record,
        the gone list and the iteration's three release keys, which on etcd were five sequential
        requests (docs/scale.md). The appends are a compare-and-swap on every appended key's mod
        revision, retried with the values the failure branch read (as ``append``); the
        set-if-absent puts are nested transactions, each with its own condition, so a key that
        is already set (an earlier fault) does not fail the others. Applied once even across a
        lost answer (``_guarded_txn``). Keys must be distinct.
        """
        keys = [_b64(self._k(k)) for k, _ in append]
        tails = [_bytes(v) for _, v in append]
        nested = [
            {
                "request_txn": {
                    "compare": [
                        {
                            "key": _b64(self._k(k)),
                            "result": "EQUAL",
                            "target": "CREATE",
                            "create_revision": 0,
                        }
                    ],
                    "success": [
                        {"request_put": {"key": _b64(self._k(k)), "value": _b64(_bytes(v))}}
                    ],
                    "failure": [],
                }
            }
            for k, v in set_if_absent
        ]
        deadline = self._deadline()
        mods = [0] * len(keys)  # guess: absent (etcd compares a missing key's mod revision as 0)
        olds: list[bytes] = [b""] * len(keys)
        while True:

            def build(seq: int, mods: list[int] = mods, olds: list[bytes] = olds) -> dict[str, Any]:
                return {
                    "compare": [
                        {"key": k, "result": "EQUAL", "target": "MOD", "mod_revision": m}
                        for k, m in zip(keys, mods, strict=True)
                    ],
                    "success": [
                        *(
                            {"request_put": {"key": k, "value": _b64(old + tail)}}
                            for k, old, tail in zip(keys, olds, tails, strict=True)
                        ),
                        *nested,
                        self._guard_put(seq, b""),
                    ],
                    "failure": [{"request_range": {"key": k}} for k in keys],
                }

            resp, done = self._guarded_txn(build, deadline, "record_fault")
            if done is not None or (resp is not None and resp.get("succeeded")):
                return
            assert resp is not None
            responses = resp.get("responses") or []
            mods, olds = [], []
            for i in range(len(keys)):
                kvs = responses[i].get("response_range", {}).get("kvs") or []
                mods.append(int(kvs[0]["mod_revision"]) if kvs else 0)
                olds.append(base64.b64decode(kvs[0].get("value", "")) if kvs else b"")
            if time.monotonic() > deadline:
                raise EtcdTimeoutError(
                    "etcd record_fault: the fault keys kept changing under this client until "
                    "the timeout: raise the store timeout"
                )

    def count_arrival(self, key: str, member: str) -> int:
        """Count ``member`` once under ``key`` and return how many members are counted: ONE
        transaction, without contention.

        ``inprocess.protocol.keys``'s barriers use it (through ``getattr``) instead of ``add``: on
        etcd
        an ``add`` is a compare-and-swap on one counter, two round trips on an existing key and
        one more per concurrent writer, so N ranks arriving together cost O(N^2) requests. Here
        each member puts its own key ``<key>/<member>`` (if absent) and the same transaction
        counts the keys under ``<key>/`` (a count-only range). Repeating it (a lost answer)
        counts nothing twice.
        """
        base = self._k(key) + b"/"
        mine = _b64(base + member.encode())
        count = {
            "request_range": {
                "key": _b64(base),
                "range_end": _b64(_prefix_end(base)),
                "count_only": True,
            }
        }
        payload = {
            "compare": [{"key": mine, "result": "EQUAL", "target": "CREATE", "create_revision": 0}],
            "success": [{"request_put": {"key": mine, "value": _b64(b"1")}}, count],
            "failure": [count],
        }
        resp = self._txn(payload, self._deadline(), "count_arrival")
        return int(resp["responses"][-1].get("response_range", {}).get("count", 0))

    def try_get(self, key: str) -> bytes | None:
        """The key's value, or None when it is absent: one range request, never blocks
        (``inprocess.protocol.keys.peek`` uses it instead of ``check`` + ``get``, two requests)."""
        return self._read(key, self._deadline())

    def try_get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """``try_get`` of several keys in ONE transaction (a consistent snapshot); never blocks
        (``inprocess.protocol.keys.peek_many``: the restart decision's inputs in one round trip)."""
        if not keys:
            return []
        payload = {
            "compare": [],
            "success": [{"request_range": {"key": _b64(self._k(k))}} for k in keys],
            "failure": [],
        }
        resp = self._txn(payload, self._deadline(), "try_get_many")
        out: list[bytes | None] = []
        for r in resp.get("responses", []):
            kvs = r.get("response_range", {}).get("kvs") or []
            out.append(base64.b64decode(kvs[0].get("value", "")) if kvs else None)
        return out

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        """Put several keys in ONE transaction (c10d's ``multi_set``; the facts every rank
        publishes at the start of an iteration). ``DELETE_VALUE`` is not special here."""
        if len(keys) != len(values):
            raise ValueError(f"multi_set: {len(keys)} keys but {len(values)} values")
        payload = {
            "compare": [],
            "success": [
                {"request_put": {"key": _b64(self._k(k)), "value": _b64(_bytes(v))}}
                for k, v in zip(keys, values, strict=True)
            ],
            "failure": [],
        }
        self._txn(payload, self._deadline(), "multi_set")

    def wait_value(self, key: str, timeout: datetime.timedelta) -> bytes:
        """``wait([key], timeout)`` then ``get(key)`` in one step: the read that finds the key,
        or the watch event that reports its put, carries the value (one round trip fewer per
        released waiter; ``inprocess.protocol.keys`` uses it through ``getattr``)."""
        return self._await(key, self._deadline(timeout), timeout.total_seconds())

    def delete_all(self) -> int:
        """Delete every key of this job (the end of a job; any rank may call it once all have
        left). Returns how many keys were deleted. Other jobs' keys are untouched."""
        start = self._root.encode()
        payload = {"key": _b64(start), "range_end": _b64(_prefix_end(start))}
        r = self._call(
            "delete_all",
            lambda c: c.post(c.get_url("/kv/deleterange"), json=payload),
            self._deadline(),
        )
        return int(r.get("deleted", 0))

    def close(self) -> None:
        """Release the HTTP connections (idempotent); the keys stay (see ``delete_all``)."""
        self._endpoints.close()

    def __enter__(self) -> EtcdStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"EtcdStore({self.address.describe()!r}, prefix={self.prefix!r})"

    # ----- waiting -----------------------------------------------------------------------------

    def _await(self, key: str, deadline: float, bound: float) -> bytes:
        """The value of ``key``: one read, and if it is absent, watch slices until it is put
        (each re-reads the key once its watch exists). ``EtcdTimeoutError`` after ``deadline``
        (``bound``: the timeout in seconds, for the message)."""
        value = self._read(key, deadline)
        while value is None:
            value = self._wait_one(key, deadline, bound)
        return value

    def _wait_one(self, key: str, deadline: float, bound: float) -> bytes | None:
        """Wait for ``key`` to be put: the value, or None after one watch slice or a failed
        watch with the key still absent (the caller opens another). ``EtcdTimeoutError`` once
        ``deadline`` passed.

        The watch starts at the current revision and the key is read once etcd confirmed it: a
        put before that confirmation is seen by the read, a later one by the watch. Not a watch
        from the revision of the caller's earlier read: etcd serves a watch that starts in the
        past from its catch-up loop, which runs every 100 ms (measured here: woken 38-77 ms
        after the put instead of 4-5 ms; the job's other writes move the revision on between
        the read and the watch almost every time)."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise EtcdTimeoutError(
                f"etcd store {self.address.describe()}: key {key!r} (prefix {self.prefix!r}) did "
                f"not appear within the timeout ({bound:.3g} s)"
            )
        index, client = self._endpoints.current()
        body = {"create_request": {"key": _b64(self._k(key)), "filters": ["NODELETE"]}}
        try:
            stream = classify(
                lambda: client.session.post(
                    client.get_url("/watch"),
                    json=body,
                    stream=True,
                    timeout=(self._endpoints.request_timeout, min(left, _WATCH_SLICE_S)),
                )
            )
        except Transient as exc:
            log.debug("etcd watch on %s failed: %s", self.address.endpoints[index], exc)
            self._endpoints.fail_over(index)
            # A read instead: paced by the endpoints' fail-over, which raises, naming them, when
            # none answers (a failed watch alone would be retried at once).
            return self._read(key, deadline)
        with contextlib.closing(stream):
            messages = _messages(stream)
            try:
                created = any(m.get("result", {}).get("created") for m in messages)
                value = self._read(key, deadline)
                if value is not None or not created:  # not created: the stream ended first
                    return value
                for m in messages:
                    for event in m.get("result", {}).get("events", []):
                        return base64.b64decode(event.get("kv", {}).get("value", ""))
            except _requests_errors() as exc:  # the slice's read timeout, or a broken stream
                log.debug("etcd watch slice on %s ended: %r", self.address.endpoints[index], exc)
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


def _failure_kv(resp: dict[str, Any]) -> dict[str, Any] | None:
    """The kv read by a transaction's failure branch (None: the key is absent)."""
    responses = resp.get("responses") or [{}]
    kvs = responses[0].get("response_range", {}).get("kvs") or []
    return kvs[0] if kvs else None


def _prefix_end(prefix: bytes) -> bytes:
    """The smallest key after every key that starts with ``prefix`` (etcd range_end)."""
    b = bytearray(prefix)
    while b:
        if b[-1] < 0xFF:
            b[-1] += 1
            return bytes(b)
        b.pop()
    return b"\0"
