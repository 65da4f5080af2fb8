"""The pieces of etcd v3 gateway requests the store builds (pure, no I/O): base64 keys and
values, puts, ranges, the compares of "set if absent" and of compare-and-swap, prefix ranges."""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def unb64(text: str) -> bytes:
    return base64.b64decode(text)


def to_bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def put(key: bytes, value: bytes) -> dict[str, Any]:
    return {"request_put": {"key": b64(key), "value": b64(value)}}


def read(key: bytes, *, count_only: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {"key": b64(key)}
    if count_only:
        body["count_only"] = True
    return {"request_range": body}


def count_prefix(prefix: bytes) -> dict[str, Any]:
    """A count-only range over every key that starts with ``prefix``."""
    return {
        "request_range": {
            "key": b64(prefix),
            "range_end": b64(prefix_end(prefix)),
            "count_only": True,
        }
    }


def absent(key: bytes) -> dict[str, Any]:
    """The compare "``key`` does not exist" (its create revision is 0)."""
    return {"key": b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": 0}


def unchanged(key: bytes, mod_revision: int) -> dict[str, Any]:
    """The compare "``key``'s mod revision is still ``mod_revision``" (0: absent)."""
    return {"key": b64(key), "result": "EQUAL", "target": "MOD", "mod_revision": mod_revision}


def equals(key: bytes, value: bytes) -> dict[str, Any]:
    return {"key": b64(key), "result": "EQUAL", "target": "VALUE", "value": b64(value)}


def txn(
    compare: Sequence[dict[str, Any]],
    success: Sequence[dict[str, Any]],
    failure: Sequence[dict[str, Any]] = (),
) -> dict[str, Any]:
    return {"compare": list(compare), "success": list(success), "failure": list(failure)}


def set_if_absent(key: bytes, value: bytes) -> dict[str, Any]:
    """A nested transaction putting ``value`` unless ``key`` exists (its own condition, so an
    existing key does not fail the enclosing transaction)."""
    return {"request_txn": txn([absent(key)], [put(key, value)])}


def range_kv(response: dict[str, Any]) -> dict[str, Any] | None:
    """The kv of one range response of a transaction (None: the key is absent)."""
    kvs = response.get("response_range", {}).get("kvs") or []
    return kvs[0] if kvs else None


def failure_kv(resp: dict[str, Any]) -> dict[str, Any] | None:
    """The kv read by a transaction's first failure-branch range (None: the key is absent)."""
    responses = resp.get("responses") or [{}]
    return range_kv(responses[0])


def kv_value(kv: dict[str, Any] | None) -> bytes | None:
    return None if kv is None else unb64(kv.get("value", ""))


def kv_mod(kv: dict[str, Any] | None) -> int:
    return 0 if kv is None else int(kv["mod_revision"])


def prefix_end(prefix: bytes) -> bytes:
    """The smallest key after every key that starts with ``prefix`` (etcd range_end)."""
    b = bytearray(prefix)
    while b:
        if b[-1] < 0xFF:
            b[-1] += 1
            return bytes(b)
        b.pop()
    return b"\0"
