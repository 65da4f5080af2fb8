"""The restart protocol run by N simulated ranks against the real store server; prints JSON.

    python benchmarks/restart_scale.py                 # N = 64, 256, 1024, 4096 (TCPStore) and
                                                       # N = 64, 256, 1024 on a 3-member etcd
    python benchmarks/restart_scale.py --quick         # CI-sized: N = 32, 128 (+ etcd 32)
    python benchmarks/restart_scale.py --png docs/restart_scale.png

Each simulated rank is a thread with its own store client (as each real rank has its own
connection), ``--ranks-per-proc`` (256) per process; there is no torch process group. They run the
restart protocol's real code (``inprocess.protocol.keys``, ``inprocess.protocol.policy``,
``inprocess.protocol.job_keys``,
``checkpoint.group`` / ``checkpoint.exchange``), in the order a real rank runs it:

* ``start``: what every rank writes when an iteration begins (participants, reserves, the
  announced iteration); then every rank blocks on the iteration's outcome, like a monitor.
* ``restart``: rank 1 is killed: its watchdog records the death (``report_fault``), which
  ends the iteration; every other rank wakes, meets at the restart barrier (the death report
  counts rank 1), one decision is taken and every participant reads it (``released``); the
  new active ranks then pass the next iteration's join barrier (``joined``).
* ``ckpt``: the checkpoint manager's store agreements of the new active ranks: the arrival
  before its dedicated group is created (``checkpoint.group``) and a local-tier step agreement
  (``StoreExchange``: gather of every rank's verdict, rank 0 publishes the result).

``--ranks-per-node`` (default 8) > 1 runs the node path instead (``restart_scale_nodes``: one
relay per node, the ranks on a node-local store; the join barrier timed in a ``join`` phase of
its own); ``--ranks-per-node 1`` runs the per-rank path described above.

Reported per N: time from the fault record to the last participant released (and joined, and
through the checkpoint agreement), store operations and payload bytes per rank (keys + values
sent, values received; not wire bytes), the store server's CPU time per phase (TCPStore server
process, or the three etcd members), the clients' CPU time, and a least-squares growth exponent
(log-log) of every quantity over N. Phases are separated by a global barrier so that each
server CPU figure belongs to one phase.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib
import json
import math
import multiprocessing as mp
import os
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from restartable.inprocess.protocol.store import StoreBase  # noqa: E402 (torch-free, after the path)

FAULT_RANK = 1  # the rank that is killed; its watchdog records the death
RANKS_PER_NODE = 8  # node_of for the decision (granularity "rank", so only bookkeeping)
# Threads per worker process: with ~1,000 threads in one process the GIL hand-offs alone took
# ~2 ms of CPU per store call here (4,096 ranks in 4 processes: 31 s to wake them all), which
# would measure Python's thread scheduling instead of the protocol.
RANKS_PER_PROC = 256
RESERVE_SHARE = 64  # one warm reserve per 64 ranks (at least one)
CONNECT_PARALLEL = 256  # concurrent connects per process (set-up only: a connect here sometimes
# stalls 5 s in a reverse name lookup, so they are overlapped)
PHASE_TIMEOUT_S = 600.0  # bound of every phase; a stuck run fails instead of hanging


# ----- a counting client ---------------------------------------------------------------------


def _n(value: Any) -> int:
    if isinstance(value, (bytes, str)):
        return len(value)
    return 8  # an integer or a flag


class CountingStore(StoreBase):
    """Wraps one store client; counts calls and payload bytes (keys and values sent, values
    received). Used by exactly one simulated rank (one thread). The protocol's fast paths are
    the inner store's own (one counted call) on etcd, and ``StoreBase``'s generic ones (their
    c10d calls counted one by one) on a TCPStore."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.ops = 0
        self.bytes_out = 0
        self.bytes_in = 0

    def snapshot(self) -> tuple[int, int, int]:
        return self.ops, self.bytes_out, self.bytes_in

    def _count(self, out: int, result: Any) -> Any:
        self.ops += 1
        self.bytes_out += out
        if isinstance(result, list):
            self.bytes_in += sum(_n(x) for x in result)
        elif result is not None:
            self.bytes_in += _n(result)
        return result

    def set(self, key: str, value: str | bytes) -> None:
        self._count(len(key) + _n(value), self.inner.set(key, value))

    def get(self, key: str) -> bytes:
        return self._count(len(key), self.inner.get(key))

    def add(self, key: str, value: int) -> int:
        return self._count(len(key) + 8, self.inner.add(key, value))

    def append(self, key: str, value: str | bytes) -> None:
        self._count(len(key) + _n(value), self.inner.append(key, value))

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        out = len(key) + _n(expected) + _n(desired)
        return self._count(out, self.inner.compare_set(key, expected, desired))

    def check(self, keys: list[str]) -> bool:
        return self._count(sum(map(len, keys)), self.inner.check(keys))

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self.ops += 1  # counted before: a wait that times out still was a round trip
        self.bytes_out += sum(map(len, keys))
        if timeout is None:
            self.inner.wait(keys)
        else:
            self.inner.wait(keys, timeout)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._count(sum(map(len, keys)), self.inner.multi_get(keys))

    def delete_key(self, key: str) -> bool:
        return self._count(len(key), self.inner.delete_key(key))

    def _fast(self, name: str, generic: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(self.inner, StoreBase):  # etcd: one request of its own
            out = sum(_n(a) for a in args if isinstance(a, (str, bytes)))
            return self._count(out, getattr(self.inner, name)(*args, **kwargs))
        return generic(self, *args, **kwargs)

    def try_get(self, key: str) -> bytes | None:
        return self._fast("try_get", StoreBase.try_get, key)

    def try_get_many(self, keys: Any) -> Any:
        return self._fast("try_get_many", StoreBase.try_get_many, keys)

    def wait_value(self, key: str, timeout: datetime.timedelta) -> bytes:
        return self._fast("wait_value", StoreBase.wait_value, key, timeout)

    def count_arrival(self, key: str, member: str | None = None) -> int:
        return self._fast("count_arrival", StoreBase.count_arrival, key, member)

    def record_fault_batch(self, **kw: Any) -> None:
        self._fast("record_fault_batch", StoreBase.record_fault_batch, **kw)

    def multi_set(self, keys: Any, values: Any) -> None:
        if isinstance(self.inner, StoreBase):
            self._fast("multi_set", StoreBase.multi_set, keys, values)
        else:  # a TCPStore: one round trip
            out = sum(map(len, keys)) + sum(_n(v) for v in values)
            self._count(out, self.inner.multi_set(keys, values))

    def __getattr__(self, name: str) -> Any:  # anything else the protocol may call
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            return self._count(
                sum(_n(a) for a in args if isinstance(a, (str, bytes))), attr(*args, **kwargs)
            )

        return counted


# ----- one simulated rank --------------------------------------------------------------------


def _setup(n: int, rpn: int = RANKS_PER_NODE) -> tuple[Any, Any, tuple[int, ...]]:
    """The assignment, config and node map every simulated rank of an N-rank job shares."""
    from restartable.inprocess.config import RestartConfig
    from restartable.inprocess.protocol.ranks import initial_assignment, node_of_ranks

    reserves = max(1, n // RESERVE_SHARE)
    node_of = node_of_ranks(world_size=n, local_world_size=min(rpn, n))
    assignment = initial_assignment(
        world_size=n, node_of=node_of, active_world_size=n - reserves, granularity="rank"
    )
    return assignment, RestartConfig(barrier_timeout=PHASE_TIMEOUT_S), node_of


def _decide(store: Any, assignment: Any, config: Any, node_of: Any, faults: list[Any]) -> str:
    """What ``inprocess.protocol.restart_meeting.decide`` does: read inputs, decide."""
    from restartable.inprocess.protocol import job_keys
    from restartable.inprocess.protocol.policy import Observed, decide

    gone, joined = job_keys.gone_and_ready_joiners(store)
    observed = Observed(
        iteration=0, faults=tuple(faults), gone=frozenset(gone), joined=frozenset(joined)
    )
    decision = decide(
        observed,
        history=[],
        assignment=assignment,
        target=len(assignment.active),
        node_of=node_of,
        config=config,
    )
    return decision.to_json()


def _phase_start(
    me: int, store: Any, shared: tuple[Any, Any, Any], *, by_node: bool = False
) -> dict[str, float]:
    from restartable.inprocess.protocol import job_keys

    assignment = shared[0]
    job_keys.start_iteration(
        store,
        0,
        participants=len(assignment.active) + len(assignment.reserve),
        reserves=assignment.reserve,
        by_node=by_node,
    )
    return {}


def _phase_restart(
    me: int, store: Any, shared: tuple[Any, Any, Any], t_fault: float
) -> dict[str, float]:
    from restartable.inprocess.clock import SYSTEM
    from restartable.inprocess.protocol import (
        barriers,
        fault_records,
        iteration_end,
        keys,
        restart_meeting,
    )
    from restartable.inprocess.protocol.policy import Decision

    assignment, config, node_of = shared
    if me == FAULT_RANK:  # this thread plays the killed rank's watchdog
        time.sleep(max(0.0, t_fault - time.time()))
        t0 = time.time()
        fault_records.report_fault(
            store, iteration=0, initial_rank=me, kind="dead", detail="SIGKILL"
        )
        return {"fault_at": t0, "recorded": time.time()}
    blocked = time.time()  # about when this rank starts waiting for the outcome
    outcome = iteration_end.wait_outcome(store, 0, timeout=PHASE_TIMEOUT_S, clock=SYSTEM)
    woken = time.time()
    assert outcome == keys.OUTCOME_FAULT, outcome
    raw = restart_meeting.restart_barrier(
        store,
        0,
        initial_rank=me,
        participants=assignment.active + assignment.reserve,
        decide=functools.partial(_decide, store, assignment, config, node_of),
        timeout=PHASE_TIMEOUT_S,
        clock=SYSTEM,
    )
    decision = Decision.from_json(raw)
    released = time.time()
    out = {"blocked": blocked, "woken": woken, "released": released}
    new = decision.assignment
    assert new is not None and FAULT_RANK in new.retired
    if new.rank_of(me) is not None:
        barriers.join_barrier(
            store, 1, expected=len(new.active), timeout=PHASE_TIMEOUT_S, clock=SYSTEM
        )
        out["joined"] = time.time()
    return out


def _phase_ckpt(me: int, store: Any, shared: tuple[Any, Any, Any]) -> dict[str, float]:
    from restartable.checkpoint.exchange import StoreExchange
    from restartable.checkpoint.group import _arrive

    assignment = shared[0]
    new_active = [r for r in assignment.active if r != FAULT_RANK] + [assignment.reserve[0]]
    if me not in new_active:
        return {}
    rank, world = new_active.index(me), len(new_active)
    t0 = time.time()
    _arrive(store, "restartable/bg/ckpt/1", world=world, timeout=PHASE_TIMEOUT_S)
    arrived = time.time()
    ex = StoreExchange(
        store,
        "restartable/ckpt/local/t/1",
        rank=rank,
        world=world,
        cancel=threading.Event(),
        timeout=PHASE_TIMEOUT_S,
    )
    flags = ex.gather("ok", True)
    if rank == 0:
        assert flags is not None
        ex.publish("verdict", all(flags))
    assert ex.receive("verdict") is True
    return {"started": t0, "arrived": arrived, "agreed": time.time()}


# ----- worker process ------------------------------------------------------------------------


def _connect(kind: str, address: str, n: int, timeout: float = PHASE_TIMEOUT_S) -> Any:
    if kind == "tcp":
        import torch.distributed as dist

        host, port = address.rsplit(":", 1)
        return dist.TCPStore(
            host,
            int(port),
            is_master=False,
            timeout=datetime.timedelta(seconds=timeout),
            wait_for_workers=False,
        )
    from restartable.inprocess.etcd import EtcdStore

    return EtcdStore(address, prefix=f"scale{n}", timeout=timeout)


def _worker(index: int, procs: int, n: int, kind: str, address: str, conn: Any) -> None:
    """One process of simulated ranks ``index, index + procs, ...``; phases on the parent's go."""
    import logging

    logging.disable(logging.WARNING)  # timed-out waits of the rare re-checks log warnings
    mine = list(range(index, n, procs))
    shared = _setup(n)
    # Imported now: a first import inside a phase (checkpoint pulls in torch.distributed
    # .checkpoint) held every thread of the process for ~2 s under the import lock.
    importlib.import_module("restartable.checkpoint.exchange")
    importlib.import_module("restartable.checkpoint.group")

    with ThreadPoolExecutor(CONNECT_PARALLEL) as pool:
        stores = dict(
            zip(
                mine,
                pool.map(lambda r: CountingStore(_connect(kind, address, n)), mine),
                strict=True,
            )
        )
    table: dict[str, Callable[..., dict[str, float]]] = {
        "start": _phase_start,
        "restart": _phase_restart,
        "ckpt": _phase_ckpt,
    }

    def jobs_of(phase: str, t_fault: float) -> dict[int, Callable[[], dict[str, float]]]:
        fn = table[phase]
        if phase == "restart":
            fn = functools.partial(fn, t_fault=t_fault)
        return {r: functools.partial(fn, r, stores[r], shared) for r in mine}

    serve_phases(conn, stores, jobs_of)


def serve_phases(
    conn: Any,
    stores: dict[int, CountingStore],
    jobs_of: Callable[[str, float], dict[int, Callable[[], dict[str, float]]]],
) -> None:
    """A worker's loop, on either path: "connected" to the parent, then for each ``(phase,
    t_fault)`` it sends, ``jobs_of(phase, t_fault)``'s jobs (by id: a rank, or ``-1 - k`` node
    k's relay) run as one thread each, and the phase's report goes back (``run_phase``);
    until None. ``stores``: every counting client of the process (the report's counts)."""
    conn.send("connected")
    while True:
        msg = conn.recv()
        if msg is None:
            break
        phase, t_fault = msg
        # Restart: hundreds of threads that each hold the GIL for microseconds between
        # blocking store calls; a thread waiting for the GIL wakes every switch interval to ask
        # for it, and with the default 5 ms those wake-ups alone burnt the CPU (4,096 ranks:
        # 31-45 s to wake them all, 1.3 s with 50 ms). The checkpoint phase polls with sleeps
        # of 1-50 ms, which a 50 ms switch interval would stretch: the default there.
        sys.setswitchinterval(0.005 if phase == "ckpt" else 0.05)
        conn.send(run_phase(jobs_of(phase, t_fault), stores, conn, waiting=phase == "restart"))
    for s in stores.values():
        close = getattr(s.inner, "close", None)
        if close is not None:
            close()


def run_phase(
    jobs: dict[int, Callable[[], dict[str, float]]],
    stores: dict[int, CountingStore],
    conn: Any,
    *,
    waiting: bool,
) -> dict[str, Any]:
    """Run ``jobs`` as one thread each; their results (with each thread's own CPU time,
    ``thread_cpu_s``), the calls and bytes of ``stores`` in the phase, the process's CPU and
    any errors. ``waiting``: tell the parent once every thread started (they block on the
    outcome: the parent then sets the fault's time running)."""
    results: dict[int, dict[str, float]] = {}
    errors: list[str] = []

    def run(i: int) -> None:
        try:
            cpu = time.thread_time()
            results[i] = jobs[i]()
            results[i]["thread_cpu_s"] = time.thread_time() - cpu
        except BaseException as exc:  # reported to the parent, which fails the run
            errors.append(f"{'relay' if i < 0 else 'rank'} {i}: {exc!r}")

    before = {i: s.snapshot() for i, s in stores.items()}
    cpu0 = time.process_time()
    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in jobs]
    for t in threads:
        t.start()
    if waiting:
        conn.send("waiting")
    for t in threads:
        t.join(PHASE_TIMEOUT_S)
    counts = {
        i: [a - b for a, b in zip(s.snapshot(), before[i], strict=True)] for i, s in stores.items()
    }
    return {
        "results": results,
        "counts": counts,
        "cpu_s": time.process_time() - cpu0,
        "errors": errors,
    }


# ----- the parent ----------------------------------------------------------------------------


def _cpu_s(pids: Sequence[int]) -> float:
    """utime + stime of the processes ``pids`` (seconds)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / tick


def _tcp_server() -> tuple[subprocess.Popen[str], str]:
    code = (
        "import sys, torch.distributed as d\n"
        "s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False)\n"
        "print(s.port, flush=True)\n"
        "sys.stdin.read()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    return proc, f"127.0.0.1:{proc.stdout.readline().strip()}"


def run_one(
    n: int,
    kind: str,
    procs: int,
    address: str,
    server_pids: Sequence[int],
    *,
    ckpt: bool,
    rpn: int = 1,
) -> dict[str, Any]:
    """One N-rank restart against the server at ``address``; returns the figures (and prints
    them to stderr at once, so that a long run shows its progress). ``rpn`` > 1: the node path
    with ``rpn`` ranks per node (``restart_scale_nodes``); 1: the per-rank path."""
    ctx = mp.get_context("spawn")
    pipes, workers = [], []
    nodes = n // rpn
    for i in range(min(procs, n if rpn == 1 else nodes)):
        parent, child = ctx.Pipe()
        target: Callable[..., None] = _worker
        args: tuple[Any, ...] = (i, procs, n, kind, address, child)
        if rpn > 1:
            import restart_scale_nodes

            target, args = restart_scale_nodes.worker, (*args, rpn)
        w = ctx.Process(target=target, args=args, daemon=True)
        w.start()
        pipes.append(parent)
        workers.append(w)

    def recv_all(what: str) -> list[Any]:
        out = []
        for p in pipes:
            if not p.poll(PHASE_TIMEOUT_S):
                raise TimeoutError(f"a worker did not report {what} within {PHASE_TIMEOUT_S} s")
            out.append(p.recv())
        return out

    try:
        recv_all("connected")
        doc: dict[str, Any] = {"n": n, "store": kind, "procs": len(workers), "ranks_per_node": rpn}
        # After the restart, the phases that stay per rank: the checkpoint agreement (per-rank
        # path), the join barrier (node path); both only up to --ckpt-max / --etcd-ckpt-max.
        after = ("ckpt",) if rpn == 1 else ("join",)
        for phase in ("start", "restart", *(after if ckpt else ())):
            # Every thread is blocked on the outcome by then (checked below): on etcd each
            # rank's first wait is a range and a watch, slower to set up than a TCPStore wait.
            t_fault = time.time() + 1.0 + n / (2000 if kind == "tcp" else 150)
            cpu0 = _cpu_s(server_pids)
            for p in pipes:
                p.send((phase, t_fault))
            if phase == "restart":
                recv_all("waiting")
            reports = recv_all(phase)
            server_cpu = _cpu_s(server_pids) - cpu0
            errors = [e for r in reports for e in r["errors"]]
            if errors:
                raise RuntimeError(f"{kind} N={n} phase {phase}: {errors[:5]}")
            results = {r: v for rep in reports for r, v in rep["results"].items()}
            counts = [c for rep in reports for c in rep["counts"].values()]
            ops = [c[0] for c in counts if c[0]]
            moved = sum(c[1] + c[2] for c in counts)
            print(f"{kind} N={n}: {phase} done", file=sys.stderr, flush=True)
            doc[phase] = {
                "store_ops_per_rank": {
                    "mean": round(sum(ops) / max(1, len(ops)), 2),
                    "max": max(ops, default=0),
                },
                "store_ops_total": sum(ops),
                "bytes_total": moved,
                "bytes_per_rank": round(moved / n, 1),
                "server_cpu_s": round(server_cpu, 3),
                "clients_cpu_s": round(sum(r["cpu_s"] for r in reports), 3),
            }
            if phase == "restart":
                released = [v["released"] for v in results.values() if "released" in v]
                joined = [v["joined"] for v in results.values() if "joined" in v]
                woken = [v["woken"] for v in results.values() if "woken" in v]
                assert len(released) == n - 1, (len(released), n)
                fault = results[FAULT_RANK]
                late = max(v["blocked"] for v in results.values() if "blocked" in v)
                if late > fault["fault_at"]:  # a rank was not waiting yet: the run is invalid
                    raise RuntimeError(
                        f"{kind} N={n}: a rank started waiting {late - fault['fault_at']:.3f} s "
                        "after the fault; the set-up margin is too short for this machine"
                    )
                t_fault = fault["fault_at"]
                doc[phase].update(
                    fault_record_s=round(fault["recorded"] - t_fault, 4),
                    fault_to_all_woken_s=round(max(woken) - t_fault, 4),
                    fault_to_all_released_s=round(max(released) - t_fault, 4),
                    fault_to_first_released_s=round(min(released) - t_fault, 4),
                    fault_to_all_joined_s=round(max(joined) - t_fault, 4) if joined else None,
                )
                fault_at = t_fault
                if rpn > 1:
                    doc[phase].update(_per_node(reports, ops, moved, nodes, rpn))
            if phase == "join":  # the node path: the join barrier timed apart
                joined = [v["joined"] for v in results.values() if "joined" in v]
                doc["restart"]["fault_to_all_joined_s"] = round(max(joined) - fault_at, 4)
            if phase == "ckpt":
                t0 = min(v["started"] for v in results.values() if "started" in v)
                doc[phase].update(
                    arrive_s=round(
                        max(v["arrived"] for v in results.values() if "started" in v) - t0, 4
                    ),
                    agreement_s=round(
                        max(v["agreed"] for v in results.values() if "started" in v) - t0, 4
                    ),
                )
        for p in pipes:
            p.send(None)
        for w in workers:
            w.join(30)
        print(json.dumps(doc), file=sys.stderr, flush=True)
        return doc
    finally:
        for w in workers:
            if w.is_alive():
                w.kill()


def _per_node(
    reports: list[Any], ops: list[int], moved: int, nodes: int, rpn: int
) -> dict[str, Any]:
    """The node path's restart figures per node: every job-store call and byte of the phase
    (relays, the decider rank, the killed rank's watchdog) over the nodes, and the relays'.
    ``fault_to_decided_s``: the decider rank took the decision (it publishes it next);
    ``fault_to_all_relayed_s``: the last relay's decision relayed to its node (the protocol's
    part: the job store and the relays); ``local_release_s``: per node, from its relay's
    order to its last rank released (the node-local part a real node runs on its own CPUs,
    here all nodes' threads on this machine's), median and max over the nodes."""
    relay_ops = [c[0] for rep in reports for i, c in rep["counts"].items() if i < 0]
    threads = [(i, v) for rep in reports for i, v in rep["results"].items()]
    fault_at = next(v["fault_at"] for i, v in threads if "fault_at" in v)
    relayed = {-1 - i: v["relayed"] for i, v in threads if i < 0}
    last: dict[int, float] = {}
    for i, v in threads:
        if i >= 0 and "released" in v:
            last[i // rpn] = max(last.get(i // rpn, 0.0), v["released"])
    local = sorted(t - relayed[k] for k, t in last.items())
    ranks_cpu = [v["thread_cpu_s"] for i, v in threads if i >= 0]
    return {
        "fault_to_decided_s": round(
            next(v["decided"] for i, v in threads if "decided" in v) - fault_at, 4
        ),
        "fault_to_all_relayed_s": round(max(relayed.values()) - fault_at, 4),
        "local_release_s": {"median": round(local[len(local) // 2], 4), "max": round(local[-1], 4)},
        "relays_cpu_s": round(sum(v["thread_cpu_s"] for i, v in threads if i < 0), 3),
        "ranks_cpu_s": round(sum(ranks_cpu), 3),
        "rank_cpu_us": round(1e6 * sum(ranks_cpu) / len(ranks_cpu)),
        "nodes": nodes,
        "store_ops_per_node": round(sum(ops) / nodes, 2),
        "bytes_per_node": round(moved / nodes, 1),
        "relay_ops": {"mean": round(sum(relay_ops) / len(relay_ops), 2), "max": max(relay_ops)},
    }


def fit_exponent(ns: Sequence[int], ys: Sequence[float | None]) -> float | None:
    """Least-squares slope of log(y) over log(N): 1.0 is linear growth, 0 constant."""
    pts = [
        (math.log(x), math.log(y)) for x, y in zip(ns, ys, strict=True) if y is not None and y > 0
    ]
    if len(pts) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    return round(sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx, 2)


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Growth exponents over N of each figure, split into what grows with N and what does not."""
    ns = [r["n"] for r in runs]
    series = {
        "restart.fault_to_all_released_s": [r["restart"]["fault_to_all_released_s"] for r in runs],
        "restart.fault_to_all_joined_s": [r["restart"]["fault_to_all_joined_s"] for r in runs],
        "restart.store_ops_per_rank": [r["restart"]["store_ops_per_rank"]["mean"] for r in runs],
        "restart.bytes_per_rank": [r["restart"]["bytes_per_rank"] for r in runs],
        "restart.bytes_total": [r["restart"]["bytes_total"] for r in runs],
        "restart.server_cpu_s": [r["restart"]["server_cpu_s"] for r in runs],
        "start.bytes_per_rank": [r["start"]["bytes_per_rank"] for r in runs],
        "restart.store_ops_per_node": [r["restart"].get("store_ops_per_node") for r in runs],
    }
    out = {k: fit_exponent(ns, v) for k, v in series.items()}
    with_ckpt = [r for r in runs if "ckpt" in r]
    cn = [r["n"] for r in with_ckpt]
    for key in ("agreement_s", "server_cpu_s"):
        out[f"ckpt.{key}"] = fit_exponent(cn, [r["ckpt"][key] for r in with_ckpt])
    out["ckpt.store_ops_per_rank"] = fit_exponent(
        cn, [r["ckpt"]["store_ops_per_rank"]["mean"] for r in with_ckpt]
    )
    return out


def plot(
    results: dict[str, list[dict[str, Any]]], path: str, baseline: dict[str, Any] | None
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = {"tcp": ("TCPStore", "C0"), "etcd": ("etcd, 3 members", "C1")}
    for kind, runs in results.items():
        label, color = styles[kind]
        ns = [r["n"] for r in runs]
        ax.plot(
            ns,
            [r["restart"]["fault_to_all_released_s"] for r in runs],
            "o-",
            color=color,
            label=label,
        )
        bx.plot(ns, [r["restart"]["bytes_per_rank"] for r in runs], "o-", color=color, label=label)
        if baseline is not None and kind in baseline:
            old = baseline[kind]
            ax.plot(
                [r["n"] for r in old],
                [r["restart"]["fault_to_all_released_s"] for r in old],
                "x--",
                color=color,
                alpha=0.6,
                label=f"{label}, before",
            )
            bx.plot(
                [r["n"] for r in old],
                [r["restart"]["bytes_per_rank"] for r in old],
                "x--",
                color=color,
                alpha=0.6,
                label=f"{label}, before",
            )
    for a in (ax, bx):
        a.set_xscale("log", base=2)
        a.set_yscale("log")
        a.set_xlabel("simulated ranks N")
        a.grid(True, which="both", alpha=0.3)
        a.legend(fontsize=8)
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set_ylabel("fault record -> last participant released (s)")
    bx.set_ylabel("store payload bytes per rank (restart)")
    fig.suptitle("Restart protocol at scale (benchmarks/restart_scale.py, 2-core VM)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="CI-sized: N = 32, 128; etcd N = 32")
    p.add_argument("--sizes", default=None, help="comma-separated N for the TCPStore ('' to skip)")
    p.add_argument("--etcd-sizes", default=None, help="comma-separated N for etcd ('' to skip)")
    p.add_argument(
        "--ranks-per-proc",
        type=int,
        default=RANKS_PER_PROC,
        help="simulated ranks (threads) per process; at least 4 processes",
    )
    p.add_argument(
        "--ckpt-max",
        type=int,
        default=1024,
        help="run the checkpoint agreement phase (the node path: the join barrier, per rank) "
        "only up to this N: its waits are polls, and 4,096 polling threads on 2 cores took over "
        "5 minutes here",
    )
    p.add_argument(
        "--etcd-ckpt-max",
        type=int,
        default=64,
        help="the same on etcd: every poll is an HTTP request (64 ranks: 17.6 s, 13.7 s of etcd "
        "CPU); the node path's per-rank join saturated 3 members at 1,024 ranks",
    )
    p.add_argument(
        "--ranks-per-node",
        type=int,
        default=RANKS_PER_NODE,
        help="simulated ranks per node: > 1 runs the node path (one relay per node, the ranks "
        "on a node-local store); 1 runs the per-rank path (every rank on the job store)",
    )
    p.add_argument("--png", default=None, help="write the curve to this PNG")
    p.add_argument("--baseline", default=None, help="an earlier JSON output drawn dashed")
    args = p.parse_args()
    tcp_default = "32,128" if args.quick else "64,256,1024,4096"
    sizes = [int(x) for x in (tcp_default if args.sizes is None else args.sizes).split(",") if x]
    etcd_default = "32" if args.quick else "64,256,1024"
    etcd_sizes = [
        int(x)
        for x in (etcd_default if args.etcd_sizes is None else args.etcd_sizes).split(",")
        if x
    ]

    # Set-up only: a client's connect may stall in a reverse name lookup (c10d formats socket
    # addresses) for the resolver's timeout, 5 s by default, when no DNS server answers (this
    # sandbox). One attempt of 1 s keeps connecting thousands of clients short; the measured
    # phases open no connection. Inherited by the server and the workers.
    os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
    import torch

    doc: dict[str, Any] = {
        "benchmark": "restart_scale",
        "host": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "loadavg_before": os.getloadavg(),
        },
        "torch": torch.__version__,
        "ranks_per_proc": args.ranks_per_proc,
        "results": {},
    }
    doc["results"]["tcp"] = []
    for n in sizes:  # a fresh server per N: no key of a smaller run is read again
        proc, address = _tcp_server()
        try:
            doc["results"]["tcp"].append(
                run_one(
                    n,
                    "tcp",
                    max(4, math.ceil(n / args.ranks_per_proc)),
                    address,
                    [proc.pid],
                    # the node path's join (blocking waits, no polls) runs at every N here
                    ckpt=n <= args.ckpt_max or args.ranks_per_node > 1,
                    rpn=args.ranks_per_node,
                )
            )
        finally:
            proc.kill()
            proc.wait()
    if etcd_sizes:
        from tests.etcd_cluster import EtcdCluster, skip_reason

        reason = skip_reason()
        if reason is not None:
            doc["etcd_skipped"] = reason
        else:
            doc["results"]["etcd"] = []
            for n in etcd_sizes:  # a fresh cluster per N (its CPU time is this run's alone)
                with EtcdCluster(members=3) as cluster:
                    pids = [pr.pid for pr in cluster.procs.values()]
                    doc["results"]["etcd"].append(
                        run_one(
                            n,
                            "etcd",
                            max(4, math.ceil(n / args.ranks_per_proc)),
                            cluster.url,
                            pids,
                            ckpt=n <= args.etcd_ckpt_max,
                            rpn=args.ranks_per_node,
                        )
                    )
    doc["growth_exponent"] = {k: summarize(v) for k, v in doc["results"].items() if len(v) > 1}
    doc["host"]["loadavg_after"] = os.getloadavg()
    if args.png:
        baseline = None
        if args.baseline:
            baseline = json.loads(Path(args.baseline).read_text())["results"]
        plot(doc["results"], args.png, baseline)
        doc["png"] = args.png
    print(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
