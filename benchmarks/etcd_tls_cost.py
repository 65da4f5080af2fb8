"""What TLS and authentication cost the etcd store: the same calls on a plain etcd and on an etcd
with TLS, client certificates and a user (both one member on loopback, started here), same run;
prints one JSON document.

    python benchmarks/etcd_tls_cost.py            # 300 samples per call, 100 restarts
    python benchmarks/etcd_tls_cost.py --quick    # smoke run: 50 and 20

Sections (medians in ms, interleaved plain / TLS / plain / TLS, the better of each pair kept):
* ``ops``: one call from a client: set, get of an existing key, ``try_get``, ``count_arrival``,
  a ``wait_value`` woken by another client's set.
* ``restart``: the restart protocol of one rank on one client (its participants, a fault
  record, the outcome, the restart barrier and the decision: the store's share of a restart).
* ``connect``: opening a client (the TLS handshake and the token request are paid here).
``tls_over_plain`` is each TLS median over the plain one. Needs ``/usr/bin/etcd``, the ``etcd``
extra and ``cryptography`` (the throwaway certificates).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.etcd_cluster, tests.etcd_secure

# The same restart protocol and timer as the sealing benchmark (benchmarks/ is sys.path[0]).
from sealing_cost import _median_us, _restart  # noqa: E402

from restartable.inprocess.etcd import EtcdStore  # noqa: E402
from tests.etcd_cluster import EtcdCluster, skip_reason  # noqa: E402
from tests.etcd_secure import SecureEtcd  # noqa: E402


def _median_ms(fn: Callable[[], Any], n: int) -> float:
    return _median_us(fn, n) / 1e3


def _woken(store: EtcdStore, other: EtcdStore, counter: list[int]) -> None:
    counter[0] += 1
    key = f"w{counter[0]}"
    threading.Timer(0.002, other.set, args=(key, "v")).start()
    store.wait_value(key, datetime.timedelta(seconds=5))


def _measure(url: str, n: int, restarts: int, counter: list[int]) -> dict[str, float]:
    prefix = f"bench-{os.getpid()}-{counter[0]}"
    out = {"connect": _median_ms(lambda: EtcdStore(url, prefix=prefix, timeout=10).close(), 10)}
    with EtcdStore(url, prefix=prefix, timeout=10) as s, \
            EtcdStore(url, prefix=prefix, timeout=10) as other:  # fmt: skip
        s.set("k", "v")
        out["set"] = _median_ms(lambda: s.set("k", "v"), n)
        out["get"] = _median_ms(lambda: s.get("k"), n)
        out["try_get"] = _median_ms(lambda: s.try_get("k"), n)
        out["count_arrival"] = _median_ms(lambda: s.count_arrival("c"), n)
        out["wait_value_woken"] = _median_ms(lambda: _woken(s, other, counter), max(10, n // 5))
        base = counter[0] * 10_000
        it = iter(range(base, base + restarts))
        out["restart"] = _median_ms(lambda: _restart(s, next(it)), restarts)
        counter[0] += restarts
        s.delete_all()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a smoke run with few samples")
    args = p.parse_args()
    if skip_reason() is not None:
        sys.exit(f"cannot run: {skip_reason()}")
    n, restarts = (50, 20) if args.quick else (300, 100)
    counter = [0]
    with tempfile.TemporaryDirectory() as d, EtcdCluster(members=1) as plain, \
            SecureEtcd(Path(d)) as secure:  # fmt: skip
        for k, v in secure.client_env().items():
            os.environ[k] = v  # the TLS client's credentials (the plain URL takes none)
        runs: dict[str, list[dict[str, float]]] = {"plain": [], "tls": []}
        for _ in range(2):
            for name, url in (("plain", plain.url), ("tls", secure.url)):
                if name == "plain":  # etcd:// must not carry TLS files: set them for TLS only
                    saved = {
                        k: os.environ.pop(k)
                        for k in list(os.environ)
                        if k.startswith("INPROCESS_ETCD_")
                    }
                runs[name].append(_measure(url, n, restarts, counter))
                if name == "plain":
                    os.environ.update(saved)
    best = {name: {k: min(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    out = {
        "benchmark": "etcd_tls_cost",
        "quick": args.quick,
        "samples": {"ops": n, "restarts": restarts},
        "host": platform.node(),
        "load_average": os.getloadavg(),
        "plain_ms": {k: round(v, 3) for k, v in best["plain"].items()},
        "tls_auth_ms": {k: round(v, 3) for k, v in best["tls"].items()},
        "tls_over_plain": {k: round(best["tls"][k] / best["plain"][k], 2) for k in best["plain"]},
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
