"""The node path of benchmarks/restart_scale.py (``--ranks-per-node`` > 1): per simulated node,
one relay (``inprocess.protocol.node_relay``, the launcher's part) and its ranks, all threads of
one worker process, the ranks meeting on a ``torch.distributed.HashStore`` of their node (a
node-local store: its calls never reach the job's store). The job's store sees what a real job
on the node path shows it: each relay's calls, the decider rank's, the killed rank's watchdog,
and what every rank writes when an iteration starts (per rank, as today).

Phases (the parent's, as on the per-rank path): ``start``; ``restart`` (the fault, every relay
and rank until released); ``join`` (the new active ranks pass the next join barrier on the job
store, per rank as today: timed apart so the restart's server CPU is the node path's alone).
"""

from __future__ import annotations

import functools
import importlib
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import restart_scale as rs

# A relay's job-store client timeout, the slice of its blocking gets: long enough that no slice
# of the measured phase times out here (the fault comes ~3 s after the phase starts at 4,096
# ranks); a real launcher's slice bounds how late it re-checks for gone nodes.
RELAY_SLICE_S = 10.0


class Node:
    """One simulated node of a worker: its local store, its relay, which of its ranks died."""

    def __init__(self, k: int, ranks: list[int], relay_store: Any) -> None:
        import torch.distributed as dist

        from restartable.inprocess.protocol.node_relay import NodeRelay, RelaySources
        from restartable.inprocess.protocol.store import C10dStore

        self.k, self.ranks, self.dead = k, ranks, set[int]()
        self.local = C10dStore(dist.HashStore())
        self.relay_store = relay_store
        self.relay = NodeRelay(
            relay_store, self.local, node=k, sources=RelaySources(dead_local=self._dead)
        )

    def _dead(self) -> set[int]:
        return set(self.dead)


def _start(me: int, store: Any, node: Node, shared: Any, state: dict[Any, Any]) -> dict[str, float]:
    from restartable.inprocess.protocol import node_barrier

    rs._phase_start(me, store, shared, by_node=True)
    assignment, _, node_of = shared
    members = [r for r in node.ranks if r in set(assignment.active + assignment.reserve)]
    node_barrier.start_node_iteration(node.local, 0, members=members, nodes=max(node_of) + 1)
    state["members", node.k] = members
    return {}


def _restart(
    me: int, store: Any, node: Node, shared: Any, state: dict[Any, Any], t_fault: float
) -> dict[str, float]:
    from restartable.inprocess.clock import SYSTEM
    from restartable.inprocess.protocol import fault_records, iteration_end, keys
    from restartable.inprocess.protocol.node_barrier import node_restart_barrier
    from restartable.inprocess.protocol.policy import Decision

    assignment, config, node_of = shared
    if me == rs.FAULT_RANK:  # the killed rank: its launcher sees the exit, its watchdog reports
        time.sleep(max(0.0, t_fault - time.time()))
        t0 = time.time()
        node.dead.add(me)
        fault_records.report_fault(
            store, iteration=0, initial_rank=me, kind="dead", detail="SIGKILL"
        )
        return {"fault_at": t0, "recorded": time.time()}
    blocked, decided = time.time(), dict[str, float]()
    outcome = iteration_end.wait_outcome(node.local, 0, timeout=rs.PHASE_TIMEOUT_S, clock=SYSTEM)
    woken = time.time()
    assert outcome == keys.OUTCOME_FAULT, outcome
    raw = node_restart_barrier(
        node.local,
        store,
        0,
        initial_rank=me,
        members=state["members", node.k],
        decide=functools.partial(_decide_timed, decided, store, assignment, config, node_of),
        timeout=rs.PHASE_TIMEOUT_S,
        clock=SYSTEM,
    )
    state[me] = Decision.from_json(raw).assignment
    return {"blocked": blocked, "woken": woken, "released": time.time(), **decided}


def _decide_timed(decided: dict[str, float], *args: Any) -> str:
    """``restart_scale._decide``; records when the decision was taken (the decider rank)."""
    out = rs._decide(*args)
    decided["decided"] = time.time()
    return out


def _relay(node: Node) -> dict[str, float]:
    from restartable.inprocess.protocol.keys import end_key

    blocked = time.time()
    outcome = node.relay.serve(0, timeout=rs.PHASE_TIMEOUT_S)
    assert outcome == "fault", outcome
    # when the outcome reached the node (the relay wrote it locally) and the decision did
    assert node.local.check([end_key(0)])
    return {"blocked": blocked, "relayed": time.time()}


def _join(me: int, store: Any, node: Node, shared: Any, state: dict[Any, Any]) -> dict[str, float]:
    from restartable.inprocess.clock import SYSTEM
    from restartable.inprocess.protocol import barriers

    new = state.get(me)
    if new is None or new.rank_of(me) is None:
        return {}
    t0 = time.time()
    barriers.join_barrier(
        store, 1, expected=len(new.active), timeout=rs.PHASE_TIMEOUT_S, clock=SYSTEM
    )
    return {"started": t0, "joined": time.time()}


def _connect_all(kind: str, address: str, n: int, ids: list[int]) -> dict[int, Any]:
    """A counting job-store client per id (a rank, or -1-k for node k's relay: its timeout is
    the relay's slice)."""

    def one(i: int) -> Any:
        if i >= 0:
            return rs.CountingStore(rs._connect(kind, address, n))
        return rs.CountingStore(rs._connect(kind, address, n, timeout=RELAY_SLICE_S))

    with ThreadPoolExecutor(rs.CONNECT_PARALLEL) as pool:
        return dict(zip(ids, pool.map(one, ids), strict=True))


def worker(index: int, procs: int, n: int, kind: str, address: str, conn: Any, rpn: int) -> None:
    """One process of whole simulated nodes ``index, index + procs, ...``; phases on the
    parent's go (``restart_scale.serve_phases``, as the per-rank path's worker)."""
    import logging

    logging.disable(logging.WARNING)
    shared = rs._setup(n, rpn)
    importlib.import_module("restartable.inprocess.protocol.node_relay")
    nodes_mine = list(range(index, n // rpn, procs))
    ranks_mine = [r for k in nodes_mine for r in range(k * rpn, (k + 1) * rpn)]
    stores = _connect_all(kind, address, n, ranks_mine + [-1 - k for k in nodes_mine])
    nodes = {k: Node(k, list(range(k * rpn, (k + 1) * rpn)), stores[-1 - k]) for k in nodes_mine}
    node_of = {r: nodes[r // rpn] for r in ranks_mine}
    state: dict[Any, Any] = {}
    table: dict[str, Callable[..., dict[str, float]]] = {
        "start": _start,
        "restart": _restart,
        "join": _join,
    }

    def jobs_of(phase: str, t_fault: float) -> dict[int, Callable[[], dict[str, float]]]:
        fn = table[phase]
        if phase == "restart":
            fn = functools.partial(fn, t_fault=t_fault)
        jobs = {
            r: functools.partial(fn, r, stores[r], node_of[r], shared, state) for r in ranks_mine
        }
        if phase == "restart":  # each node's relay (its launcher's part) runs beside its ranks
            jobs.update({-1 - k: functools.partial(_relay, nodes[k]) for k in nodes_mine})
        return jobs

    rs.serve_phases(conn, stores, jobs_of)
