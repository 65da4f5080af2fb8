"""EtcdStore semantics against a real etcd (one member; three for failover), and URL parsing."""

from __future__ import annotations

import datetime
import importlib.util
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from restartable.inprocess.errors import ConfigError, StoreTimeoutError
from restartable.inprocess.etcd import EtcdStore, EtcdStoreError
from restartable.inprocess.etcd.errors import EtcdTimeoutError
from restartable.inprocess.etcd.url import parse_url
from tests.etcd_cluster import EtcdCluster, skip_reason
from tests.multiproc import free_ports

needs_etcd = pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason()))
needs_client = pytest.mark.skipif(
    importlib.util.find_spec("etcd3gw") is None,
    reason="etcd3gw is not installed: pip install -e '.[etcd]'",
)


# ----- URL parsing (pure) -------------------------------------------------------------------


def test_url_lists_every_endpoint_in_order_with_default_port_and_prefix() -> None:
    a = parse_url("etcd://h1:2379,h2,[::1]:3000/job-7/a")
    assert a.endpoints == (("h1", 2379), ("h2", 2379), ("::1", 3000))
    assert a.prefix == "job-7/a"
    assert parse_url("ETCD://h:1").prefix is None


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("http://h:2379", "must start with etcd://"),
        ("etcd://", "names no endpoint"),
        ("etcd://h:notaport", "'notaport', not a TCP port"),
        ("etcd://h:70000", "not a TCP port"),
        ("etcd://h1:2379,,h2:2379", "has no valid host"),
        ("etcd://h:2379/bad prefix!", "job prefix 'bad prefix!'"),
    ],
)
def test_malformed_url_is_a_config_error_naming_the_url_and_the_form(url: str, says: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_url(url)
    assert says in str(err.value) and repr(url) in str(err.value)


# ----- semantics against a real etcd --------------------------------------------------------


@pytest.fixture(scope="module")
def cluster() -> Iterator[EtcdCluster]:
    if skip_reason() is not None:
        pytest.skip(str(skip_reason()))
    with EtcdCluster(members=1) as c:
        yield c


@pytest.fixture
def s(cluster: EtcdCluster, request: pytest.FixtureRequest) -> Iterator[EtcdStore]:
    s = EtcdStore(cluster.url, prefix=_safe(f"unit-{request.node.name}")[:60], timeout=5.0)
    yield s
    s.delete_all()
    s.close()


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name).strip("-")


@needs_etcd
def test_set_get_add_append_check_delete_follow_c10d(s: EtcdStore) -> None:
    s.set("a", "1")
    s.set("b", b"\x00\xffbin")
    assert s.get("a") == b"1" and s.get("b") == b"\x00\xffbin"
    assert s.add("n", 2) == 2 and s.add("n", -5) == -3
    s.append("l", "x,")
    s.append("l", b"y,")
    assert s.get("l") == b"x,y,"
    assert s.check(["a", "n", "l"]) and not s.check(["a", "missing"])
    assert s.num_keys() == 4
    assert s.delete_key("a") and not s.delete_key("a")
    assert not s.check(["a"])


@needs_etcd
def test_compare_set_empty_expected_means_set_if_absent(s: EtcdStore) -> None:
    assert s.compare_set("go", "", "fault") == b"fault"
    assert s.compare_set("go", "", "done") == b"fault"  # first writer wins
    assert s.compare_set("go", "fault", "next") == b"next"
    assert s.compare_set("go", "fault", "x") == b"next"
    # c10d: an absent key with a non-empty expected value answers the expected value.
    assert s.compare_set("absent", "e", "d") == b"e"
    assert not s.check(["absent"])


@needs_etcd
def test_get_and_wait_block_until_the_key_is_set_by_a_watch(s: EtcdStore) -> None:
    threading.Timer(0.3, lambda: s.set("late", "v")).start()
    t0 = time.monotonic()
    assert s.get("late") == b"v"
    waited = time.monotonic() - t0
    # Woken by the watch, not by a poll period (a slice is 1 s).
    assert 0.25 < waited < 0.9, waited
    threading.Timer(0.2, lambda: s.set("w2", "v")).start()
    s.wait(["late", "w2"], datetime.timedelta(seconds=3))
    assert s.check(["w2"])


@needs_etcd
def test_wait_times_out_with_a_timeout_error_naming_the_key(s: EtcdStore) -> None:
    import torch.distributed as dist

    t0 = time.monotonic()
    with pytest.raises(StoreTimeoutError) as err:
        s.wait(["never"], datetime.timedelta(seconds=0.4))
    assert 0.35 < time.monotonic() - t0 < 2.0
    assert "'never'" in str(err.value) and "0.4 s" in str(err.value)
    assert isinstance(err.value, dist.DistStoreError)  # what c10d's stores raise


@needs_etcd
def test_concurrent_adds_from_many_clients_are_atomic(cluster: EtcdCluster) -> None:
    clients = [EtcdStore(cluster.url, prefix="unit-adds", timeout=20.0) for _ in range(4)]
    results: list[int] = []
    lock = threading.Lock()

    def bump(c: EtcdStore) -> None:
        for _ in range(10):
            v = c.add("n", 1)
            with lock:
                results.append(v)

    threads = [threading.Thread(target=bump, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(results) == list(range(1, 41))  # every value handed out exactly once
    clients[0].delete_all()


@needs_etcd
def test_jobs_with_different_prefixes_never_see_each_other(cluster: EtcdCluster) -> None:
    old = EtcdStore(cluster.url, prefix="job-old", timeout=2.0)
    new = EtcdStore(cluster.url + "/job-new", timeout=2.0)
    old.set("restartable/it0/end", "fault")
    assert not new.check(["restartable/it0/end"])
    assert old.delete_all() >= 1 and new.num_keys() == 0
    assert not old.check(["restartable/it0/end"])


@needs_etcd
def test_a_process_group_and_prefix_store_work_over_it(s: EtcdStore) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore("restartable/it0/pg", s),
        rank=0,
        world_size=1,
    )
    try:
        t = torch.ones(3)
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0, 1.0]
    finally:
        dist.destroy_process_group()


# ----- bad input ----------------------------------------------------------------------------


@needs_client
def test_unreachable_endpoints_fail_naming_them_and_the_timeout() -> None:
    dead = free_ports(2)
    url = "etcd://" + ",".join(f"127.0.0.1:{p}" for p in dead)
    t0 = time.monotonic()
    with pytest.raises(StoreTimeoutError) as err:
        EtcdStore(url, prefix="j", timeout=0.5)
    assert time.monotonic() - t0 < 3.0
    msg = str(err.value)
    assert all(f"127.0.0.1:{p}" in msg for p in dead) and "timeout" in msg, msg


@needs_client
def test_a_server_without_the_v3_api_is_refused() -> None:
    import http.server

    class NotEtcd(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.send_error(404)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotEtcd)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(EtcdStoreError, match="v3 API"):
            EtcdStore(f"etcd://127.0.0.1:{server.server_address[1]}", prefix="j", timeout=2.0)
    finally:
        server.shutdown()
        server.server_close()


def test_missing_prefix_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="no job prefix"):
        EtcdStore("etcd://127.0.0.1:1", timeout=0.1)


# ----- failover on a 3-member cluster -------------------------------------------------------


@needs_etcd
def test_killing_the_leader_costs_a_short_stall_and_no_lost_or_doubled_update() -> None:
    with EtcdCluster(members=3) as c:
        s = EtcdStore(c.url, prefix="failover", timeout=20.0, request_timeout=2.0)
        waiter = EtcdStore(c.url, prefix="failover", timeout=20.0, request_timeout=2.0)
        got: list[bytes] = []
        t = threading.Thread(target=lambda: got.append(waiter.get("after")))
        t.start()
        for _ in range(5):
            s.add("n", 1)
        leader = c.leader()
        c.kill(leader)
        t0 = time.monotonic()
        assert s.add("n", 1) == 6  # counted once, whichever member answered
        stall = time.monotonic() - t0
        s.set("after", "x")
        t.join(10)
        assert got == [b"x"], "a waiter survives the loss of the member it watched"
        assert stall < 5.0, f"losing the leader stalled a write for {stall:.2f} s"
        assert s.get("n") == b"6"


# ----- the wiring's helper ------------------------------------------------------------------


def test_job_prefix_comes_from_the_url_else_the_job_id_and_rounds_get_their_own() -> None:
    from restartable.inprocess.etcd.connect import job_prefix

    assert job_prefix("etcd://h:1/from-url", "job-9") == "from-url"
    assert job_prefix("etcd://h:1", "job-9") == "job-9"
    assert job_prefix("etcd://h:1", "job-9", round_=2) == "job-9/round2"
    with pytest.raises(ConfigError, match="needs a job id"):
        job_prefix("etcd://h:1", None)


@pytest.mark.parametrize("prefix", ["/", "a b", "a//b", "x?"])
def test_bad_prefix_is_a_config_error_naming_it(prefix: str) -> None:
    with pytest.raises(ConfigError, match="EtcdStore prefix") as err:
        EtcdStore("etcd://127.0.0.1:1", prefix=prefix, timeout=0.1)
    assert repr(prefix) in str(err.value)


@needs_etcd
def test_a_write_whose_answer_was_lost_is_applied_once(s: EtcdStore) -> None:
    """etcd commits, then the answer is lost (a member dying mid-request): the retry must find
    the write through the guard instead of counting a barrier arrival twice."""
    from etcd3gw import exceptions as ex

    client = s._endpoints.current()[1]
    real = client.transaction
    lost: list[int] = []

    def commit_then_lose_answer(payload: Any) -> Any:
        answer = real(payload)
        if len(lost) < 2:
            lost.append(1)
            raise ex.ConnectionFailedError("answer lost")
        return answer

    client.transaction = commit_then_lose_answer  # type: ignore[method-assign,assignment]
    assert s.add("n", 5) == 5
    s.append("l", "x,")
    assert lost == [1, 1]
    assert s.get("n") == b"5" and s.get("l") == b"x,"


@needs_etcd
def test_a_write_committed_after_the_client_gave_up_is_applied_once(s: EtcdStore) -> None:
    """The first request times out, etcd commits it later, between the retry's guard check and
    the retry itself: the retry's compare fails and must be recognised as this client's own."""
    from etcd3gw import exceptions as ex

    s.add("n", 1)
    client = s._endpoints.current()[1]
    real = client.transaction
    late: list[Any] = []

    def commit_late(payload: Any) -> Any:
        if not late:
            late.append(payload)
            raise ex.ConnectionTimeoutError("request timed out")
        if late[-1] is not None:
            real(late[-1])  # the first attempt lands now
            late.append(None)
        return real(payload)

    client.transaction = commit_late  # type: ignore[method-assign,assignment]
    assert s.add("n", 10) == 11
    assert s.get("n") == b"11"


def test_the_watchdog_process_reports_on_the_etcd_store(cluster: EtcdCluster) -> None:
    # The watchdog's connection with --store-url / --job-id: its report lands in the job's
    # namespace on etcd, where the ranks read it (the TCP host and port are not used).
    import argparse

    from restartable.inprocess.clock import SYSTEM
    from restartable.inprocess.protocol import keys
    from restartable.inprocess.watchdog import process
    from restartable.inprocess.watchdog.watch import StoreReport, Verdict

    args = argparse.Namespace(
        store_url=cluster.url,
        job_id="wd-job",
        store_host="unused",
        store_port=1,
        initial_rank=3,
        reserve=False,
    )
    dead = Verdict("dead", "rank process 1 disappeared", initial_rank=3, iteration=0, reserve=False)
    # No first client (None): the report opens one from the arguments, as the process does.
    StoreReport(None, connect=lambda: process._connect(args), clock=SYSTEM)(dead)
    with EtcdStore(cluster.url, prefix="wd-job", timeout=10) as job:
        assert keys.gone_ranks(job) == {3}
        job.delete_all()


# ----- the restart protocol's batched calls (docs/scale.md) -----------------------------------


@needs_etcd
def test_record_fault_batch_is_one_transaction_and_loses_no_concurrent_append(
    s: EtcdStore, cluster: EtcdCluster
) -> None:
    client = s._endpoints.current()[1]
    real = client.transaction
    txns: list[Any] = []

    def counting(payload: Any) -> Any:
        txns.append(payload)
        return real(payload)

    client.transaction = counting  # type: ignore[method-assign,assignment]
    s.record_fault_batch(append=[("f", "a\n"), ("g", "1,")], set_if_absent=[("end", "fault")])
    assert len(txns) == 1  # fresh keys: one round trip for the appends and the release
    other = EtcdStore(cluster.url, prefix=s.prefix, timeout=20.0)
    with ThreadPoolExecutor(4) as pool:  # concurrent writers: every append lands once
        list(
            pool.map(
                lambda i: (other if i % 2 else s).record_fault_batch(
                    append=[("f", f"r{i}\n")], set_if_absent=[("end", f"late{i}")]
                ),
                range(8),
            )
        )
    other.close()
    lines = s.get("f").decode().splitlines()
    assert sorted(lines) == sorted(["a", *(f"r{i}" for i in range(8))])
    assert s.get("g") == b"1," and s.get("end") == b"fault"  # set if absent: the first stays


@needs_etcd
def test_wait_value_returns_the_value_a_watch_saw_or_times_out(s: EtcdStore) -> None:
    threading.Timer(0.2, s.set, args=("late", "v")).start()
    assert s.wait_value("late", datetime.timedelta(seconds=5)) == b"v"
    assert s.wait_value("late", datetime.timedelta(seconds=5)) == b"v"  # present: one read
    with pytest.raises(EtcdTimeoutError, match="never"):
        s.wait_value("never", datetime.timedelta(seconds=0.2))


@needs_etcd
def test_count_arrival_counts_each_member_once_in_one_transaction(
    s: EtcdStore, cluster: EtcdCluster
) -> None:
    from restartable.inprocess.protocol import fault_records, keys, restart_meeting

    other = EtcdStore(cluster.url, prefix=s.prefix, timeout=20.0)
    with ThreadPoolExecutor(8) as pool:  # 12 arrivals of 8 members, from two clients at once
        list(
            pool.map(lambda i: (other if i % 2 else s).count_arrival("b/n", f"m{i % 8}"), range(12))
        )
    other.close()
    assert s.count_arrival("b/n", "m0") == 8  # a repeated arrival counts nothing
    # The restart barrier counts a live rank and a death report of the same rank once.
    s.set(keys.iteration_prefix(0) + "restart/expected", "2")
    fault_records.report_fault(s, iteration=0, initial_rank=1, kind="dead", detail="x")
    fault_records.report_fault(s, iteration=0, initial_rank=1, kind="dead", detail="again")
    assert s.count_arrival(keys.iteration_prefix(0) + "restart/n", "1") == 1
    got = restart_meeting.restart_barrier(
        s,
        0,
        initial_rank=0,
        participants=[0, 1],
        decide=lambda f: f"{len(f)} faults",
        timeout=10.0,
    )
    assert got == "2 faults"


@needs_etcd
def test_multi_set_and_try_get_many_are_one_transaction_each(s: EtcdStore) -> None:
    from restartable.inprocess.protocol import keys

    calls: list[str] = []
    txn = s._keys.txn

    def counted(payload: dict[str, Any], deadline: float, what: str) -> dict[str, Any]:
        calls.append(what)
        return txn(payload, deadline, what)

    s._keys.txn = counted  # type: ignore[method-assign]
    keys.set_many(s, {"a": "1", "b": "", "c": "3"})
    assert keys.peek_many(s, ["a", "b", "missing", "c"]) == [b"1", b"", None, b"3"]
    assert calls == ["multi_set", "try_get_many"]
    with pytest.raises(ValueError, match="2 keys but 1 values"):
        s.multi_set(["x", "y"], ["1"])


@needs_etcd
def test_group_rendezvous_on_etcd_meets_on_the_hosts_tcpstore(
    s: EtcdStore, cluster: EtcdCluster
) -> None:
    """The group's rank 0 hosts the rendezvous; a peer finds it through etcd and keeps its
    client across iterations; the keys never touch etcd."""
    from restartable.inprocess.restart.rendezvous import Rendezvous, advertised_host

    where = advertised_host(parse_url(cluster.url).endpoints)
    host = Rendezvous(s, me=3, hosted=True, advertise=where, timeout=5.0)
    peer = Rendezvous(s, me=5, hosted=True, advertise=where, timeout=5.0)
    host.prepare(host=3)
    peer.prepare(host=3)  # not the host: nothing to do
    before = s.num_keys()
    peer.store(3).set("it1/pg/x", "from the peer")
    assert host.store(3).get("it1/pg/x") == b"from the peer"
    assert peer.store(3) is peer.store(3)  # one client per host, kept
    peer.forget(3)
    assert peer.store(3).get("it1/pg/x") == b"from the peer"  # connects afresh
    assert s.num_keys() == before  # only the address was published, before
    plain = Rendezvous(s, me=0, hosted=False, advertise="", timeout=5.0)
    plain.prepare(host=0)
    assert plain.store(0) is s  # the TCPStore path: the coordination store itself
    for r in (host, peer, plain):
        r.close()


def test_advertised_host_is_the_interface_that_reaches_the_store() -> None:
    from restartable.inprocess.restart.rendezvous import advertised_host

    assert advertised_host((("127.0.0.1", 2379),)) == "127.0.0.1"


# ----- launchers on etcd: one namespace per job step, staleness without comparing clocks ----


def _control(cluster: EtcdCluster, job_id: str, node: int, **kw: Any) -> Any:
    from restartable.inprocess.launch.rounds import JobControl

    return JobControl(
        node_rank=node,
        nnodes=2,
        addr="127.0.0.1",
        port=None,
        store_url=cluster.url,
        job_id=job_id,
        **kw,
    )


@needs_etcd
def test_a_second_srun_step_never_deletes_the_first_steps_keys(cluster: EtcdCluster) -> None:
    from restartable.inprocess.launch.launch_id import TOKEN_KEY
    from restartable.inprocess.protocol.environment import slurm_job_step

    job = f"4711{uuid.uuid4().hex[:6]}"
    steps = [slurm_job_step({"SLURM_JOB_ID": job, "SLURM_STEP_ID": str(i)}) for i in (0, 1)]
    assert steps[0] != steps[1]
    first = _control(cluster, str(steps[0]), 0, node_timeout=5.0)
    try:
        second = _control(cluster, str(steps[1]), 0, node_timeout=5.0)  # deletes ITS stale keys
        second.delete_job_keys()
        second.close()
        assert first.store.check([TOKEN_KEY])  # the first step's launch is intact
    finally:
        first.delete_job_keys()
        first.close()


@needs_etcd
def test_the_last_launcher_out_never_judges_a_live_node_by_its_skewed_clock(
    cluster: EtcdCluster,
) -> None:
    # Issue 33: node 1's wall clock is 3 s behind node 0's; node 0 compared node 1's beat (its
    # wall time) with its own clock, found it "stale" and deleted the job's keys under it.
    from restartable.inprocess.clock import Clock
    from restartable.inprocess.launch.launch_id import TOKEN_KEY

    job = f"skew-{uuid.uuid4().hex[:8]}"
    node0 = _control(cluster, job, 0, node_timeout=4.0, beat_stale=1.0)
    node1 = _control(
        cluster,
        job,
        1,
        node_timeout=4.0,
        beat_stale=1.0,
        clock=Clock(wall=lambda: time.time() - 3.0),
    )
    stop = threading.Event()

    def beat() -> None:
        while not stop.is_set():
            node1.report_live(0, 1)
            stop.wait(0.1)

    beating = threading.Thread(target=beat, daemon=True)
    beating.start()
    try:
        node0.report_live(0, 0)
        leaving = threading.Thread(target=node0.leave, daemon=True)
        leaving.start()
        leaving.join(1.5)  # longer than beat_stale: node 1 beats, so node 0 keeps waiting
        assert leaving.is_alive() and node1.store.check([TOKEN_KEY])
        stop.set()
        beating.join(5)
        node1.leave()  # the last one out: node 0 left, so node 1 deletes every key
        leaving.join(5)
        assert not leaving.is_alive()
        with EtcdStore(cluster.url, prefix=job, timeout=5.0) as s:
            assert s.num_keys() == 0
    finally:
        stop.set()
        node0.close()
        node1.close()


@needs_etcd
def test_a_launcher_whose_beat_stopped_is_gone_after_beat_stale(cluster: EtcdCluster) -> None:
    job = f"stale-{uuid.uuid4().hex[:8]}"
    node0 = _control(cluster, job, 0, node_timeout=10.0, beat_stale=0.5)
    node1 = _control(cluster, job, 1, node_timeout=10.0, beat_stale=0.5)
    try:
        node1.report_live(0, 1)  # then node 1 dies without leaving
        t0 = time.monotonic()
        node0.leave()
        assert time.monotonic() - t0 < 5.0  # ~beat_stale on node 0's own clock, not 10 s
        with EtcdStore(cluster.url, prefix=job, timeout=5.0) as s:
            assert s.num_keys() == 0  # the last one out deleted the job's keys
    finally:
        node0.close()
        node1.close()
