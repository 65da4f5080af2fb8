"""One round of the job on this node (``run_round``): open the round with the other launchers,
start and supervise this node's ranks, stop them, and read what every node agreed ends the round.
``LauncherRound`` is the supervisor's one collaborator (``supervisor.RoundLink``): what the
launcher's flags, the control store and the journal tell a round."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping

from restartable.inprocess.launch.actions import Action, restart_or_end
from restartable.inprocess.launch.drill import FaultDrill
from restartable.inprocess.launch.launcher_journal import LauncherJournal
from restartable.inprocess.launch.node_host import NodeHost, etcd_job_client
from restartable.inprocess.launch.node_lost import NodeLostError
from restartable.inprocess.launch.pool import WarmPool
from restartable.inprocess.launch.rank_env import rank_env
from restartable.inprocess.launch.rounds import JobControl
from restartable.inprocess.launch.supervisor import (
    NodeSupervisor,
    RoundEnd,
    SupervisorConfig,
    kill_children,
)
from restartable.inprocess.protocol import job_keys
from restartable.inprocess.protocol.store import Store


class LauncherRound:
    """Round ``k`` as the supervisor sees the rest of the job (``RoundLink``): built by
    ``run_round`` once ``JobControl.open_round(k)`` returned the round's ``port`` and ``store``;
    every method is called from the supervisor's thread and may raise ``NodeLostError``."""

    def __init__(
        self,
        args: argparse.Namespace,
        control: JobControl,
        k: int,
        *,
        port: int,
        store: Store,
        jr: LauncherJournal,
    ) -> None:
        self._args, self._control, self._k = args, control, k
        self._port, self._store, self._jr = port, store, jr
        self.node: NodeHost | None = None  # --restart-by node: the round's local store, relay
        self.gone: frozenset[int] = frozenset()  # the stale launchers at the last look
        self._gone_wanted = False  # the relay asked (at a re-check): look at the next tick

    def env_of(self, local: int, generation: int) -> Mapping[str, str]:
        c, k = self._control, self._k
        store_env = {**c.round_store_env(k), **(self.node.env() if self.node else {})}
        return rank_env(
            self._args, local, self._port, generation, store_env, round_=k, launch_id=c.launch_id
        )

    def poll_action(self) -> str | None:
        a = self._control.action(self._k)
        return None if a is None else a.reason

    def on_stopped(self, reason: str) -> None:
        origin = job_keys.stop_origin(self._store)
        self._control.request(
            self._k,
            restart_or_end(
                self._k, max_restarts=self._args.max_restarts, reason=reason, origin=origin
            ),
        )

    def report_live(self, n: int) -> None:
        self._control.report_live(self._k, n)

    def job_gone(self) -> bool:
        return self._control.job_gone(self._k)

    def on_tick(self) -> None:
        self._jr.follow(self._store)
        if self._gone_wanted:  # on the supervisor's thread: the control store's client is its
            self._gone_wanted = False
            self.gone = self._control.gone_nodes()

    def relay_gone(self) -> frozenset[int]:
        """The relay's ``gone_nodes`` (its thread, at a re-check after a slice without a
        decision): the launchers seen gone at the last look, and a new look at the next tick.
        Only on demand: a look reads every other launcher's beat, and on every tick of every
        launcher that would be O(nodes^2) control-store calls per tick (a launcher's beat goes
        stale in ``beat_stale`` seconds from the first look; a restart waits that much more
        for a lost launcher, never for a live one)."""
        self._gone_wanted = True
        return self.gone


def supervisor_config(args: argparse.Namespace) -> SupervisorConfig:
    """What the launcher's flags say about this node's processes."""
    return SupervisorConfig(
        script=[args.script, *args.args],
        node_rank=args.node_rank,
        nproc_per_node=args.nproc_per_node,
        world_size=args.nnodes * args.nproc_per_node,
        master_addr=args.master_addr,
        max_respawns=args.max_respawns,
        respawn_backoff=args.respawn_backoff,
        monitor_interval=args.monitor_interval,
        stop_grace=args.stop_grace,
    )


def run_round(
    args: argparse.Namespace,
    control: JobControl,
    k: int,
    current: list[NodeSupervisor],
    jr: LauncherJournal,
    pool: WarmPool | None = None,
) -> tuple[RoundEnd, Action | None]:
    """One round on this node: start the ranks, supervise them, stop them; the round's end and
    the action (restart or end) every node agreed on, if any. Blocks for the whole round;
    ``current`` holds the round's supervisor meanwhile (the launcher's signal handler forwards
    to it). Raises ``NodeLostError`` when another launcher or the control store is gone."""
    port, store = control.open_round(k)
    link = LauncherRound(args, control, k, port=port, store=store, jr=jr)
    sup = NodeSupervisor(
        cfg=supervisor_config(args),
        store=store,
        link=link,
        out=sys.stdout.buffer,
        pool=pool,
        warm_initial=k > 0,  # an in-job restart forks every rank from the pool
    )
    current[:] = [sup]
    if args.restart_by == "node":
        link.node = node_host(args, control, k, port, sup, link)
    drill = None
    if k == 0 and args.simulated_fault_type is not None:
        drill = FaultDrill(
            sup,
            kind=args.simulated_fault_type,
            rank=args.simulated_fault_rank,
            base_delay=args.simulated_fault_base_delay,
        )
    try:
        end = sup.run()
        action = control.action(k) if end.kind == "action" else None
        if action is not None and action.kind == "restart":
            # The launcher already logs why; every second the old ranks take to leave on their
            # own is downtime, so they get SIGTERM at once (then --stop-grace, then SIGKILL).
            sup.stop_children(patience=0.0)
    except NodeLostError:
        kill_children(sup)  # the control store (node 0) or a node is gone: 75, quietly
        raise
    finally:
        sup.close()  # ends what still runs (an action from another node, or a failure here)
        if link.node is not None:
            link.node.close()
        if drill is not None:
            drill.close()
    return end, action


def node_host(
    args: argparse.Namespace,
    control: JobControl,
    k: int,
    port: int,
    sup: NodeSupervisor,
    link: LauncherRound,
) -> NodeHost:
    """``--restart-by node``: round ``k``'s node store and relay; its sources are this node's
    children that exited (``sup.exits``) and the launchers ``link.relay_gone`` last saw gone. The
    job store: the round's TCPStore on ``port``, or with ``--store`` the round's namespace on
    etcd."""
    job_store = etcd_job_client(control.round_store_env(k)) if args.store else None
    return NodeHost(
        node=args.node_rank,
        round_=k,
        job_addr=args.master_addr,
        job_port=port,
        sealer=control.round_sealer(k),
        dead_local=lambda: [identity for identity, _ in tuple(sup.exits)],
        gone_nodes=link.relay_gone,
        barrier_timeout=args.node_timeout,
        job_store=job_store,
    )
