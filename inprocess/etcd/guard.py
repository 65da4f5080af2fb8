"""Non-idempotent etcd writes (``add``, ``append``, the fault batch) applied once, even when
the answer to a request that etcd committed is lost."""

from __future__ import annotations

import itertools
import threading
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from restartable.inprocess.etcd import txn as t

if TYPE_CHECKING:
    from etcd3gw.client import Etcd3Client

    from restartable.inprocess.etcd.endpoints import Endpoints


class WriteGuard:
    """One client's guard key ``<root>ops/<uuid>`` and the sequence of its guarded writes.

    A guarded transaction puts the guard key with value ``"<seq>:<result>"`` in its success
    branch. If a request fails after etcd may have committed it (the member died before
    answering, or committed it after this client's request timeout), the guard tells whether it
    did. Thread-safe (one sequence per client, under a lock).
    """

    def __init__(self, root: str) -> None:
        self.key = f"{root}ops/{uuid.uuid4().hex}".encode()
        self._seq = itertools.count(1)
        self._lock = threading.Lock()

    def put(self, seq: int, result: bytes) -> dict[str, Any]:
        """The success-branch put that marks write ``seq`` applied, with ``result``."""
        return t.put(self.key, f"{seq}:".encode() + result)

    def run(
        self,
        endpoints: Endpoints,
        build: Callable[[int], dict[str, Any]],
        deadline: float,
        what: str,
    ) -> tuple[dict[str, Any] | None, bytes | None]:
        """Run the transaction ``build(seq)`` once, even across a lost response.

        ``build`` adds ``put(seq, result)`` to its success branch. Returns ``(None, result)``
        when an earlier attempt was applied (instead of applying the write twice: a counter of
        a barrier counted twice would release it early), else ``(response, None)``; the first
        failure response is the caller's own read.
        """
        with self._lock:
            seq = next(self._seq)
        payload = build(seq)
        # The failure branch also reads the guard: an earlier attempt that etcd committed late
        # (after this client gave up on it) makes the compare fail, and must not be taken for
        # another writer's change.
        payload["failure"] = [*payload["failure"], t.read(self.key)]
        tag = f"{seq}:".encode()
        attempts = 0

        def applied(kv: dict[str, Any] | None) -> bytes | None:
            value = t.kv_value(kv) or b""
            return value[len(tag) :] if value.startswith(tag) else None

        def attempt(c: Etcd3Client) -> tuple[dict[str, Any] | None, bytes | None]:
            nonlocal attempts
            attempts += 1
            if attempts > 1:  # an earlier attempt failed, maybe after etcd committed it
                r = c.post(c.get_url("/kv/range"), json={"key": t.b64(self.key)})
                kvs = r.get("kvs") or []
                done = applied(kvs[0] if kvs else None)
                if done is not None:
                    return None, done
            resp: dict[str, Any] = dict(c.transaction(payload))
            if not resp.get("succeeded"):
                responses: list[dict[str, Any]] = resp.get("responses") or []
                done = applied(t.range_kv(responses[-1]) if responses else None)
                if done is not None:
                    return None, done
            return resp, None

        return endpoints.call(what, attempt, deadline=deadline)
