"""The restart barrier by node (``node_relay`` + ``node_barrier``): relays on a real TCPStore
server, each node's ranks (threads) on a HashStore of their own; a rank's death, a relay that
dies mid-restart, a decider node gone before it published, the outcome "done", a stop, and a
rank death on a real etcd."""

from __future__ import annotations

import datetime
import json
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator

import pytest
import torch.distributed as dist

from restartable.inprocess.errors import FaultRecord
from restartable.inprocess.etcd import EtcdStore
from restartable.inprocess.protocol import fault_records, iteration_end, keys
from restartable.inprocess.protocol import node_barrier as nb
from restartable.inprocess.protocol.node_relay import NodeRelay, RelaySources
from restartable.inprocess.protocol.store import C10dStore, Store
from tests.etcd_cluster import EtcdCluster, skip_reason

SLICE_S = 0.3  # a relay's job-store client timeout: the slice of its blocking gets
TEST_TIMEOUT_S = 20.0  # every wait of a test is bounded by this


class Counting(C10dStore):
    """A job-store client that counts its calls."""

    def __init__(self, inner: dist.Store) -> None:
        super().__init__(inner)
        self.calls = 0
        for name in ("set", "get", "add", "append", "compare_set", "check", "wait", "multi_get"):
            setattr(self, name, self._counted(getattr(self, name)))

    def _counted(self, fn: Callable[..., object]) -> Callable[..., object]:
        def call(*args: object) -> object:
            self.calls += 1
            return fn(*args)

        return call


@pytest.fixture
def server() -> Iterator[dist.TCPStore]:
    yield dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def client(server: dist.TCPStore, timeout: float = TEST_TIMEOUT_S) -> Counting:
    raw = dist.TCPStore(
        "127.0.0.1",
        server.port,
        is_master=False,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout),
    )
    return Counting(raw)


def decide(faults: list[FaultRecord]) -> str:
    return json.dumps(sorted({f.initial_rank for f in faults}))


class Job:
    """``nodes`` x ``per_node`` ranks; node k holds ranks k*per_node ...; one relay per node."""

    def __init__(self, connect: Callable[[float], Store], nodes: int, per_node: int) -> None:
        self.nodes, self.per_node = nodes, per_node
        self.local = [C10dStore(dist.HashStore()) for _ in range(nodes)]
        self.dead: set[int] = set()
        self.gone: set[int] = set()
        self.relays = [
            NodeRelay(
                connect(SLICE_S),
                self.local[k],
                node=k,
                sources=RelaySources(dead_local=self._dead, gone_nodes=self._gone),
            )
            for k in range(nodes)
        ]
        # the ranks' job-store client, shared: they only read and publish there (each connect
        # may stall ~5 s in a reverse name lookup in this sandbox, so the test opens few)
        self.shared = connect(TEST_TIMEOUT_S)
        self.decisions: dict[int, str] = {}
        self.errors: list[BaseException] = []
        self.threads: list[threading.Thread] = []

    def _dead(self) -> Collection[int]:
        return set(self.dead)

    def _gone(self) -> Collection[int]:
        return set(self.gone)

    def ranks(self, node: int) -> list[int]:
        return list(range(node * self.per_node, (node + 1) * self.per_node))

    def start(self, fn: Callable[[], object]) -> None:
        def run() -> None:
            try:
                fn()
            except BaseException as exc:
                self.errors.append(exc)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        self.threads.append(t)

    def rank(self, node: int, r: int) -> None:
        local, job = self.local[node], self.shared
        nb.start_node_iteration(local, 0, members=self.ranks(node), nodes=self.nodes)
        assert iteration_end.wait_outcome(local, 0, timeout=TEST_TIMEOUT_S) == "fault"
        self.decisions[r] = nb.node_restart_barrier(
            local,
            job,
            0,
            initial_rank=r,
            members=self.ranks(node),
            decide=decide,
            timeout=TEST_TIMEOUT_S,
        )

    def serve(self, nodes: Iterable[int], *, skip: Collection[int] = ()) -> None:
        """Start the relays of ``nodes`` and their ranks but those in ``skip`` (a killed rank)."""
        for k in nodes:
            self.start(lambda k=k: self.relays[k].serve(0, timeout=TEST_TIMEOUT_S))
            for r in self.ranks(k):
                if r not in skip:
                    self.start(lambda k=k, r=r: self.rank(k, r))

    def join(self) -> None:
        for t in self.threads:
            t.join(TEST_TIMEOUT_S + 5)
            assert not t.is_alive(), "a thread is still waiting: the barrier hung"
        assert not self.errors, self.errors


def tcp(server: dist.TCPStore) -> Callable[[float], Store]:
    """Job-store clients of ``server`` with a given timeout."""
    return lambda timeout: client(server, timeout)


def kill(job: Job, rank: int) -> None:
    """Rank ``rank`` dies: its launcher sees it at once, its watchdog records the death."""
    job.dead.add(rank)
    fault_records.report_fault(
        job.shared, iteration=0, initial_rank=rank, kind="dead", detail="SIGKILL"
    )


def test_a_rank_death_releases_every_live_rank_with_three_job_calls_per_node(server):
    job = Job(tcp(server), nodes=4, per_node=4)
    job.serve(range(job.nodes), skip={1})
    kill(job, 1)
    job.join()
    assert set(job.decisions) == set(range(16)) - {1}
    assert set(job.decisions.values()) == {"[1]"}  # one decision, on the death's record
    calls = sorted(r.job.calls for r in job.relays)  # type: ignore[attr-defined]
    # get end, add, get go; the decider node: full instead of the get (its rank hands it over)
    assert calls == [3, 3, 3, 3], calls


def test_a_relay_gone_mid_restart_is_counted_by_the_others(server):
    job = Job(tcp(server), nodes=3, per_node=2)
    # node 2's relay dies with its ranks before counting its node: nobody serves node 2
    job.serve((0, 1))
    job.gone.add(2)
    job.dead.update(job.ranks(2))
    kill(job, 4)
    job.join()
    assert set(job.decisions) == {0, 1, 2, 3}
    assert set(job.decisions.values()) == {"[4]"}


def test_a_decider_node_gone_before_it_published_is_replaced(server):
    job = Job(tcp(server), nodes=3, per_node=2)
    job.serve((0, 1))
    kill(job, 5)
    raw = job.shared
    raw.wait([keys.key(0, "restart/nodes/n")], datetime.timedelta(seconds=TEST_TIMEOUT_S))
    # node 2's relay counts its node last, completes the count, then dies with its ranks
    for _ in range(int(TEST_TIMEOUT_S / 0.01)):
        if raw.add(keys.key(0, "restart/nodes/n"), 0) >= 2:
            break
        threading.Event().wait(0.01)
    raw.add(keys.key(0, "restart/nodes/n"), 1)
    raw.compare_set(keys.key(0, "restart/nodes/full"), "", "2")
    job.gone.add(2)
    job.join()
    assert set(job.decisions) == {0, 1, 2, 3}
    assert set(job.decisions.values()) == {"[5]"}


def test_the_decider_rank_dead_before_it_published_is_replaced_on_its_node(server):
    job = Job(tcp(server), nodes=2, per_node=2)
    decider_dies = threading.Event()

    def rank0() -> None:  # rank 0 is named the decider (lowest live rank) and dies instead
        local = job.local[0]
        nb.start_node_iteration(local, 0, members=job.ranks(0), nodes=2)
        iteration_end.wait_outcome(local, 0, timeout=TEST_TIMEOUT_S)
        nb.count_local(local, 0, job.ranks(0), 0, alive=True, by="0")
        local.wait([nb.local_key(0, "order/0")], datetime.timedelta(seconds=TEST_TIMEOUT_S))
        job.dead.add(0)
        decider_dies.set()

    for k in (0, 1):
        job.start(lambda k=k: job.relays[k].serve(0, timeout=TEST_TIMEOUT_S))
    job.start(rank0)
    job.start(lambda: job.rank(0, 1))
    job.start(lambda: job.rank(1, 2))
    kill(job, 3)
    job.join()
    assert decider_dies.is_set()
    assert set(job.decisions) == {1, 2}
    assert set(job.decisions.values()) == {"[3]"}


def test_done_is_relayed_and_stop_ends_a_healthy_wait(server):
    local = C10dStore(dist.HashStore())
    relay = NodeRelay(client(server, SLICE_S), local, node=0, sources=RelaySources(frozenset))
    stopped = threading.Event()
    client(server).set(keys.end_key(0), keys.OUTCOME_DONE)
    assert relay.serve(0, timeout=1.0) == "done"
    assert iteration_end.outcome(local, 0) == "done"
    stopped.set()
    assert relay.serve(1, timeout=1.0, stop=stopped.is_set) is None


def test_a_node_without_members_is_a_clear_error():
    with pytest.raises(ValueError, match=r"members=.*nodes=0"):
        nb.start_node_iteration(C10dStore(dist.HashStore()), 0, members=[1], nodes=0)


def test_one_local_add_counts_a_rank_and_a_rank_counted_alive_then_dead_counts_once():
    local, members = C10dStore(dist.HashStore()), [4, 5, 6]
    assert not nb.count_local(local, 0, members, 5, alive=True, by="5")
    assert not nb.count_local(local, 0, members, 5, alive=False, by="relay")  # died after
    assert nb.arrived_alive(local, 0, members) == {5}
    assert not nb.count_local(local, 0, members, 6, alive=False, by="relay")
    assert not local.check([nb.local_key(0, "full")])  # 4 is neither in nor dead
    assert nb.count_local(local, 0, members, 4, alive=True, by="4")  # the add that covers all
    assert local.get(nb.local_key(0, "full")) == b"4"
    assert nb.arrived_alive(local, 0, members) == {4, 5}


def test_a_node_of_more_members_than_the_local_count_holds_is_a_clear_error():
    with pytest.raises(ValueError, match=r"32 members on one node; at most 31"):
        nb.start_node_iteration(C10dStore(dist.HashStore()), 0, members=range(32), nodes=1)


@pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason()))
def test_on_etcd_a_rank_death_releases_every_live_rank():
    with EtcdCluster(members=1) as cluster:
        job = Job(
            lambda timeout: EtcdStore(cluster.url, prefix="node-path", timeout=timeout),
            nodes=3,
            per_node=2,
        )
        job.serve(range(job.nodes), skip={1})
        kill(job, 1)
        job.join()
    assert set(job.decisions) == {0, 2, 3, 4, 5}
    assert set(job.decisions.values()) == {"[1]"}


def test_an_orphan_count_is_taken_over_at_the_periodic_recheck_by_a_node_with_a_live_rank(
    server, monkeypatch
):
    # Node 2's ranks all died, its launcher lives: its relay completes the count last, with no
    # live rank to decide (restart/nodes/full = "orphan"). No node went, so the waiting relays
    # find the orphan at their periodic re-read of restart/nodes/full (FULL_RECHECK_S, here
    # 1.5 s; not every 0.3 s slice), and one with a live rank takes over. Node 2's relay reads
    # it first (its first re-check): it must leave the claim (it took it, and the job hung
    # until the timeout, before 2 December 2026).
    from restartable.inprocess.protocol import node_relay

    monkeypatch.setattr(node_relay, "FULL_RECHECK_S", 1.5)
    job = Job(tcp(server), nodes=3, per_node=2)
    reads: dict[int, int] = {}
    peek = node_relay.peek

    def counted(store: Store, k: str) -> bytes | None:
        if k.endswith("restart/nodes/full"):
            node = next(i for i, r in enumerate(job.relays) if r.job is store)
            reads[node] = reads.get(node, 0) + 1
        return peek(store, k)

    monkeypatch.setattr(node_relay, "peek", counted)
    nb.start_node_iteration(job.local[2], 0, members=job.ranks(2), nodes=3)
    job.dead.update(job.ranks(2))  # they started the iteration, then died
    job.serve((0, 1))
    kill(job, 4)
    raw = job.shared
    for _ in range(int(TEST_TIMEOUT_S / 0.01)):  # nodes 0 and 1 counted, wait for the decision
        if raw.add(keys.key(0, "restart/nodes/n"), 0) >= 2:
            break
        threading.Event().wait(0.01)
    threading.Event().wait(2 * SLICE_S)  # ... and read restart/nodes/full once (absent)
    t0 = time.monotonic()
    job.start(lambda: job.relays[2].serve(0, timeout=TEST_TIMEOUT_S))
    job.join()
    took = time.monotonic() - t0
    assert raw.get(keys.key(0, "restart/nodes/full")) == node_relay.ORPHAN.encode()
    assert raw.get(keys.key(0, "restart/nodes/claim")) in (b"0", b"1")
    assert set(job.decisions) == {0, 1, 2, 3}
    assert set(job.decisions.values()) == {"[4]"}
    assert took < 1.5 + 4 * SLICE_S + 2.0, took  # found at the periodic re-read
    # Re-read at most every FULL_RECHECK_S, not every slice (~2 reads each, not ~6).
    assert max(reads.get(k, 0) for k in (0, 1)) <= 3, reads
