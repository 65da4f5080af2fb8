"""The coordination store on etcd against the embedded TCPStore, same run; prints one JSON document.

    python benchmarks/store_etcd.py            # ops x 300, leader loss x 3, restarts x 5
    python benchmarks/store_etcd.py --quick    # smoke run: ops x 50, 1 leader loss, 2 restarts

Sections:
* ``ops``: median / p90 latency (ms) of one call from a client (set, get of an existing key,
  add, compare_set, check, wait on an existing key, and a get woken by another client's set)
  on a TCPStore server vs an ``EtcdStore`` on a 3-member etcd cluster on loopback.
* ``leader_loss``: how long one ``add`` takes when the etcd leader was SIGKILLed just before.
* ``restart``: a 3-rank ``@restartable`` job (tests/dist/workers_etcd.py:bench_restarts) with
  an exception restart every few steps: restart latency (fault -> every rank finished the next
  iteration's first all_reduce) and the mean step time (an all_reduce + ``ctx.ping``) of
  fault-free steps, on the TCPStore and on etcd (selected by INPROCESS_STORE /
  INPROCESS_JOB_ID, as a user selects it).

Needs ``/usr/bin/etcd`` (Debian's etcd-server) and the ``etcd`` extra.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.etcd_cluster, tests.multiproc

from tests.etcd_cluster import EtcdCluster, skip_reason  # noqa: E402


def _stats(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {
        "median_ms": round(1e3 * statistics.median(s), 3),
        "p90_ms": round(1e3 * s[min(len(s) - 1, math.ceil(0.9 * len(s)) - 1)], 3),
        "n": len(s),
    }


def _time(fn: Callable[[int], Any], n: int) -> list[float]:
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        fn(i)
        out.append(time.perf_counter() - t0)
    return out


def _stamped_set(store: Any, key: str, started: list[float]) -> None:
    started.append(time.perf_counter())
    store.set(key, "v")


def measure_ops(store: Any, other: Any, n: int) -> dict[str, dict[str, float]]:
    """Per-op latency of ``store``; ``other`` (a second client) sets the keys a get waits for."""
    store.set("present", "v")
    result = {
        "set": _stats(_time(lambda i: store.set(f"s{i}", "v"), n)),
        "get": _stats(_time(lambda i: store.get("present"), n)),
        "add": _stats(_time(lambda i: store.add("counter", 1), n)),
        "compare_set": _stats(_time(lambda i: store.compare_set(f"c{i}", "", "v"), n)),
        "check": _stats(_time(lambda i: store.check(["present"]), n)),
        "wait_present": _stats(
            _time(lambda i: store.wait(["present"], datetime.timedelta(seconds=5)), n)
        ),
    }
    # A get that blocks until another client sets the key: from the start of that set to the
    # return of the get (the set's own round trip included).
    woken = []
    for i in range(max(5, n // 10)):
        started: list[float] = []
        setter = threading.Timer(0.02, _stamped_set, args=(other, f"late{i}", started))
        setter.start()
        store.get(f"late{i}")
        woken.append(time.perf_counter() - started[0])
        setter.join(5)
    result["set_to_woken_get"] = _stats(woken)
    return result


def bench_ops(n: int) -> dict[str, Any]:
    import torch.distributed as dist

    from restartable.inprocess.etcd import EtcdStore

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def tcp_client() -> Any:
        return dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False)

    tcp = measure_ops(tcp_client(), tcp_client(), n)
    with EtcdCluster(members=3) as cluster:
        etcd = measure_ops(
            EtcdStore(cluster.url, prefix="bench"), EtcdStore(cluster.url, prefix="bench"), n
        )
    ratios = {op: round(etcd[op]["median_ms"] / tcp[op]["median_ms"], 1) for op in tcp}
    return {"tcpstore": tcp, "etcd_3_members": etcd, "median_ratio_etcd_over_tcp": ratios}


def bench_leader_loss(trials: int) -> dict[str, Any]:
    from restartable.inprocess.etcd import EtcdStore

    stalls = []
    for _ in range(trials):
        with EtcdCluster(members=3) as cluster:
            store = EtcdStore(cluster.url, prefix="bench", timeout=30)
            store.add("n", 1)
            cluster.kill(cluster.leader())
            t0 = time.perf_counter()
            store.add("n", 1)
            stalls.append(time.perf_counter() - t0)
            assert store.get("n") == b"2"
    return {
        "add_after_leader_kill": _stats(stalls),
        "samples_s": [round(s, 3) for s in stalls],
    }


def bench_restart(trials: int) -> dict[str, Any]:
    from tests.multiproc import run_ranks

    def one(use_etcd: bool, env: dict[str, str]) -> dict[str, Any]:
        outs = run_ranks(
            3,
            target="tests.dist.workers_etcd:bench_restarts",
            kwargs={"trials": trials, "gap": 3, "timed_steps": 100, "use_etcd": use_etcd},
            env=env,
            host_store=True,  # the TCPStore run's store; unused by the etcd run's protocol
            deadline=60 + 20 * trials,
        )
        faults = {k: v for o in outs for k, v in o.result["faults"].items()}
        latencies = [
            max(o.result["resumed"][str(int(it) + 1)] for o in outs) - t for it, t in faults.items()
        ]
        steps = [s for o in outs for s in o.result["step_s"]]
        return {
            "restart": _stats(latencies),
            "step": _stats(steps),
            "restart_samples_s": [round(x, 3) for x in latencies],
        }

    tcp = one(False, {})
    with EtcdCluster(members=3) as cluster:
        etcd = one(True, {"INPROCESS_STORE": cluster.url, "INPROCESS_JOB_ID": "bench"})
    return {
        "tcpstore": tcp,
        "etcd_3_members": etcd,
        "restart_median_ratio": round(
            etcd["restart"]["median_ms"] / tcp["restart"]["median_ms"], 2
        ),
        "step_median_ratio": round(etcd["step"]["median_ms"] / tcp["step"]["median_ms"], 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a smoke run with few samples")
    args = p.parse_args()
    reason = skip_reason()
    if reason is not None:
        sys.exit(f"store_etcd benchmark cannot run: {reason}")
    n, losses, restarts = (50, 1, 2) if args.quick else (300, 3, 5)
    import torch

    doc = {
        "benchmark": "store_etcd",
        "host": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "torch": torch.__version__,
        "ops": bench_ops(n),
        "leader_loss": bench_leader_loss(losses),
        "restart": bench_restart(restarts),
    }
    print(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
