"""The wiring of the restart by node (``--restart-by node``): the launcher's ``NodeHost`` (a
node store on 127.0.0.1 and a relay thread, on a real TCPStore job store) and the rank's
``NodePath`` (which ranks are its node's, and the variable that turns it on)."""

from __future__ import annotations

import argparse
import datetime

import pytest
import torch.distributed as dist

from restartable.checkpoint.sealing import ForgedValueError, Sealer, new_secret
from restartable.inprocess.config import RestartConfig
from restartable.inprocess.errors import ConfigError
from restartable.inprocess.launch.launcher_round import LauncherRound
from restartable.inprocess.launch.node_deaths import REPORT_GRACE_S, ReportedDeaths
from restartable.inprocess.launch.node_host import NodeHost
from restartable.inprocess.protocol import fault_records, iteration_end, keys
from restartable.inprocess.protocol import node_barrier as nb
from restartable.inprocess.protocol.environment import LaunchEnv
from restartable.inprocess.protocol.node_barrier import NODE_STORE_ENV
from restartable.inprocess.protocol.sealed_store import seal
from restartable.inprocess.protocol.store import C10dStore
from restartable.inprocess.restart import startup
from restartable.inprocess.restart.abort import GroupReaper
from restartable.inprocess.restart.node_path import NodePath
from tests.fake_clock import FakeClock

pytestmark = pytest.mark.timeout(60)


def _job_server() -> dist.TCPStore:
    return dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(20)
    )


def _host(
    server: dist.TCPStore, *, node: int, round_: int, sealer: Sealer | None = None
) -> NodeHost:
    return NodeHost(
        node=node,
        round_=round_,
        job_addr="127.0.0.1",
        job_port=int(server.port),
        sealer=sealer,
        dead_local=tuple,
        gone_nodes=frozenset,
        barrier_timeout=10.0,
    )


def test_node_host_relays_the_end_to_its_ranks_and_stops_with_the_round() -> None:
    server = _job_server()
    host = _host(server, node=0, round_=0)
    try:
        path = NodePath.from_environ(
            host.env(), rank=0, world_size=2, local_world_size=2, timeout=10.0
        )
        assert path is not None
        C10dStore(server).set(keys.end_key(0), keys.OUTCOME_DONE)
        got = iteration_end.wait_outcome(path.local, 0, timeout=10.0)
        assert got == keys.OUTCOME_DONE  # the ranks' monitors see it on their node's store
    finally:
        host.close()
    assert not host._thread.is_alive()


def test_a_value_another_local_user_writes_on_the_node_store_is_refused() -> None:
    # The node store listens on 127.0.0.1: a second local client (no secret) can write there.
    # The relay and the ranks seal with the job's key, so its forged decision or end is refused
    # as on the job's store (ForgedValueError, logged), and the relay's own values still open.
    sealer = Sealer(bytes.fromhex(new_secret()))
    server = _job_server()
    host = _host(server, node=0, round_=0, sealer=sealer)
    try:
        env = host.env()
        path = NodePath.from_environ(
            env, rank=0, world_size=2, local_world_size=2, timeout=10.0, sealer=lambda: sealer
        )
        assert path is not None
        stranger = C10dStore(dist.TCPStore("127.0.0.1", host.port, is_master=False))
        stranger.set(nb.local_key(0, "order/0"), nb.ORDER_GO + '{"stop": true}')
        with pytest.raises(ForgedValueError):
            path.local.get(nb.local_key(0, "order/0"))
        seal(C10dStore(server), sealer).set(keys.end_key(0), keys.OUTCOME_DONE)
        assert iteration_end.wait_outcome(path.local, 0, timeout=10.0) == keys.OUTCOME_DONE
    finally:
        host.close()


def test_node_host_close_stops_a_relay_blocked_on_a_running_iteration() -> None:
    server = _job_server()
    host = _host(server, node=1, round_=3)
    host.close()  # the iteration never ends: the relay sees the stop within one slice
    assert not host._thread.is_alive()


def test_without_the_variable_the_rank_keeps_the_per_rank_path() -> None:
    assert NodePath.from_environ({}, rank=0, world_size=4, local_world_size=2, timeout=1) is None


def test_a_bad_node_store_value_names_the_variable_and_the_fix() -> None:
    with pytest.raises(ConfigError, match=f"{NODE_STORE_ENV}='nowhere'.*host:port"):
        NodePath.from_environ(
            {NODE_STORE_ENV: "nowhere"}, rank=0, world_size=4, local_world_size=2, timeout=1
        )


def test_members_are_this_nodes_ranks_respawned_identities_included() -> None:
    server = _job_server()  # any reachable store stands for the node's
    env = {NODE_STORE_ENV: f"127.0.0.1:{server.port}"}
    path = NodePath.from_environ(env, rank=3, world_size=4, local_world_size=2, timeout=5)
    assert path is not None and path.node == 1
    # identity 6 = slot 2 respawned once (2 + 1 * 4): on node 1, as slot 2 is; 5: slot 1, node 0
    assert path.members([0, 1, 2, 6, 5, 7]) == (2, 6, 7)


def test_on_the_node_path_the_monitors_wait_for_the_end_on_the_node_store() -> None:
    # The monitors' clients (``RankServices.clients``) are the node store's: each rank's wait
    # for the iteration's end is answered by its relay's copy, not by a get on the job store.
    server = _job_server()
    host = _host(server, node=0, round_=0)
    try:
        path = NodePath.from_environ(
            host.env(), rank=1, world_size=2, local_world_size=2, timeout=10.0
        )
        assert path is not None
        env = LaunchEnv(
            rank=1,
            local_rank=1,
            world_size=2,
            local_world_size=2,
            master_addr="127.0.0.1",
            master_port=int(server.port),
            store_hosted=True,
        )
        job = C10dStore(server)
        svc = startup.rank_services(
            RestartConfig(),
            env,
            me=1,
            store=job,
            new_client=lambda: job,
            reaper=GroupReaper(rank=1),
            url=None,
            end_client=path.new_client,
        )
        client = svc.clients.take()
        path.local.set("only-on-the-node-store", "x")
        assert client.get("only-on-the-node-store") == b"x"
        job.set(keys.end_key(0), keys.OUTCOME_FAULT)
        assert iteration_end.wait_outcome(client, 0, timeout=10.0) == keys.OUTCOME_FAULT
        svc.clients.give(client)
    finally:
        host.close()


class _Control:
    """The part of ``JobControl`` a tick reads: how often the launchers' beats were looked at."""

    def __init__(self) -> None:
        self.looks = 0

    def gone_nodes(self) -> frozenset[int]:
        self.looks += 1
        return frozenset({1})


class _Journal:
    def follow(self, store: object) -> None:
        pass


def test_the_other_launchers_beats_are_read_only_when_the_relay_asks() -> None:
    # Every look reads each other launcher's beat on the control store: on every tick of every
    # launcher that is O(nodes^2) calls per tick, so a tick looks only after the relay asked.
    control = _Control()
    link = LauncherRound(
        argparse.Namespace(),
        control,  # type: ignore[arg-type]
        0,
        port=0,
        store=None,  # type: ignore[arg-type]
        jr=_Journal(),  # type: ignore[arg-type]
    )
    for _ in range(5):
        link.on_tick()
    assert control.looks == 0
    assert link.relay_gone() == frozenset()  # the last look's (none yet); one look is due
    link.on_tick()
    link.on_tick()
    assert control.looks == 1
    assert link.relay_gone() == frozenset({1})


def test_an_exited_rank_is_counted_dead_once_its_watchdog_reported_it_or_after_the_grace() -> None:
    # The launcher sees its child exit before the watchdog's record is on the job store:
    # counted then, the decision could be taken without the record (the restart blamed only
    # the collateral faults). A report appends the record and then the rank to ``gone``; on
    # the node path it counts nothing on the job store (the iteration is marked by node), so
    # the relay must not wait for a count (it did: every death waited out the grace, 5 s).
    fake = FakeClock()
    job = C10dStore(dist.HashStore())
    job.set(*keys.participants_item(2, 4, by_node=True))
    exited: list[int] = [3]
    deaths = ReportedDeaths(job, lambda: exited, clock=fake.clock())
    assert deaths() == []  # exited, not reported yet
    fault_records.report_fault(job, iteration=2, initial_rank=3, kind="dead", detail="gone")
    assert fault_records.read_faults(job, 2)[0].initial_rank == 3
    assert deaths() == [3]
    exited.append(1)  # a rank whose watchdog died with it: counted after the grace
    assert deaths() == [3]
    fake.advance(REPORT_GRACE_S)
    assert deaths() == [3, 1]
