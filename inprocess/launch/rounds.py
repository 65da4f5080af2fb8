"""How the launchers of one job agree on the job's rounds: the store each round's ranks use, and
what happens when a round ends (an in-job restart, or the end of the job with a status).

The control keys live under ``launch/`` (``<ns>`` below) in the control store. Without
``--store``, node 0's launcher hosts it, a TCPStore on ``--master-port``, for the whole job
(round 0's ranks use that store too; every later round gets a fresh store, so no key of an
earlier round is ever read again):

* ``launch/token``         the launch id and when node 0 drew it (JSON; sealed with the job's
                           secret; RESTARTABLE_LAUNCH_ID of every rank). Every other value is
                           sealed with a key derived from that id (``launch_sealer``), each
                           round's ranks with one derived from it and the round
* ``<ns>r{k}/port``        the port of round ``k``'s store (node 0 publishes it)
* ``<ns>r{k}/arrived``     launchers ready to start round ``k`` (all must arrive)
* ``<ns>r{k}/action``      what ends round ``k`` for every node: JSON ``{"kind": "restart" |
                           "end", "status", "reason"}``; first writer wins
* ``<ns>r{k}/live/{n}``    processes node ``n`` still runs or will respawn
* ``<ns>beat/{n}``         node ``n``'s launcher's beat: a value that changes while it runs (a
                           count; the reader times it with its own monotonic clock, so no host
                           compares another host's clock)
* ``<ns>standin/{n}``      the same kind of value, written by the ``inprocess.srun_task`` that
                           stands in for node ``n``'s killed launcher: the waits before leaving
                           count it, a restart's ``gone_nodes`` does not
* ``<ns>left/{n}``         node ``n``'s launcher is leaving (node 0 waits for the live ones)
* ``<ns>end``              the job's exit status, first launcher to end writes it (read by the
                           ``inprocess.srun_task`` of a launcher that was killed: it stands in for
                           that launcher, beating (``standin``) and leaving in its name, until it
                           read this)

With ``--store etcd://...`` (``store_url``) no launcher hosts anything: the control keys are on
etcd too, in the job's namespace under ``launch/<launch id>/`` (so losing any one node, node 0
included, loses no coordination state), and the ranks' store of round ``k`` is the etcd
namespace ``job_prefix(url, job_id, round_=k)``: every launcher opens its own etcd clients
(``round_store_env`` tells the ranks which namespace). Node 0 deletes the job's stale keys
(a requeued Slurm job keeps its job id) and then publishes ``launch/token`` (the launch id and
when it was drawn); the other launchers wait for a token drawn after they started (less
``node_timeout`` of clock skew), so they never join a crashed earlier run's keys. The last
launcher to leave deletes every key of the job (``leave``): a launcher counts as gone when it
left, or when its beat did not change for ``beat_stale`` seconds of the reader's own monotonic
clock (never by comparing the wall clocks of two hosts: 2 s of skew would have deleted a live
node's keys).

``JobControl`` is the launcher's one handle on all of it; each job has its own unit: the
backend, chosen once by name (``control_backend``: ``control_tcp`` or ``control_etcd``), the
launch id (``launch_id``), the meeting before each round (``arrival``), the beats and the leaving
(``liveness``), and what ends a round (``actions``).
"""

from __future__ import annotations

import logging

from restartable.checkpoint.sealing import SECRET_ENV, Sealer
from restartable.inprocess.clock import SYSTEM, Clock
from restartable.inprocess.launch.actions import Action
from restartable.inprocess.launch.arrival import Arrival
from restartable.inprocess.launch.control_backend import choose_backend
from restartable.inprocess.launch.control_store import ControlStore
from restartable.inprocess.launch.launch_id import launch_sealer, settle_launch_id
from restartable.inprocess.launch.liveness import Liveness
from restartable.inprocess.launch.node_lost import NodeLostError, store_lost
from restartable.inprocess.protocol.sealed_store import seal
from restartable.inprocess.protocol.store import Store

log = logging.getLogger(__name__)


class JobControl:
    """This launcher's side of the control store (node 0 hosts it, or the etcd cluster holds
    it with ``store_url``; close() drops it).

    Call order per round ``k``: ``open_round(k)`` (every launcher; blocks at most
    ``node_timeout`` for the others) -> supervise -> ``request(k, ...)`` by whichever launcher
    decides -> ``action(k)`` read by all. ``leave()`` once at the end.
    """

    def __init__(
        self,
        *,
        node_rank: int,
        nnodes: int,
        addr: str,
        port: int | None,
        node_timeout: float,
        beat_stale: float = 5.0,
        store_url: str | None = None,
        job_id: str | None = None,
        launch_id: str | None = None,
        sealer: Sealer | None = None,
        clock: Clock = SYSTEM,
    ) -> None:
        """Connect to (node 0: host, or with etcd: open) the control store and settle the
        launch id: ``launch_id`` on node 0 (default: a new one), node 0's on the others, who
        wait for it at most ``node_timeout`` (``NodeLostError`` after that). ``sealer``: the
        job's secret; every value of the control store and of the round stores is sealed with
        it (``inprocess.protocol.sealed_store``), so a forged action is rejected, never obeyed.
        ``clock``: where this launcher's time comes from (a test skews it)."""
        self.node_rank, self.clock = node_rank, clock
        self._backend = choose_backend(
            store_url=store_url,
            job_id=job_id,
            node_rank=node_rank,
            addr=addr,
            port=port,
            node_timeout=node_timeout,
        )
        self._control = self._open(sealer, launch_id)
        self._arrival = Arrival(
            self._control, nnodes=nnodes, node_timeout=node_timeout, clock=clock
        )
        self._liveness = Liveness(
            self._control,
            node_rank=node_rank,
            nnodes=nnodes,
            beat_stale=beat_stale,  # a launcher whose beat is unchanged this long is gone
            node_timeout=node_timeout,
            clock=clock,
        )

    def _open(self, sealer: Sealer | None, launch_id: str | None) -> ControlStore:
        """Open the control store, settle the launch id, then bind every later value to the
        launch: sealed with its own key, nothing another launch sealed (even one that shares the
        secret) verifies."""
        raw = self._backend.open_control()
        self.launch_id = settle_launch_id(
            seal(raw, sealer),
            node_rank=self.node_rank,
            launch_id=launch_id,
            node_timeout=self._backend.node_timeout,
            clock=self.clock,
        )
        self._sealer = None if sealer is None else launch_sealer(sealer, self.launch_id)
        return ControlStore(seal(raw, self._sealer), self._backend.namespace(self.launch_id))

    @property
    def store(self) -> Store:
        """The control store, sealed with the launch's key."""
        return self._control.store

    def round_sealer(self, k: int) -> Sealer | None:
        """The key of round ``k``'s store and ranks (``round_store_env``); None without one."""
        return None if self._sealer is None else self._sealer.derive("round", str(k))

    def _k(self, name: str) -> str:
        return self._control.key(name)

    # ----- rounds ----------------------------------------------------------------------------

    def open_round(self, k: int) -> tuple[int, Store]:
        """Meet every launcher for round ``k``; returns the round store's port and a client of
        it. Raises ``NodeLostError`` when a launcher does not arrive within ``node_timeout``."""
        try:
            self._arrival.arrive(k)
            self._backend.host_round(k, self._control, self.round_sealer(k))
            self._arrival.wait_for_all(k)
            return self._backend.join_round(k, self._control, self.round_sealer(k))
        except NodeLostError:
            raise
        except Exception as exc:
            raise store_lost(exc) from exc

    def round_store_env(self, k: int) -> dict[str, str]:
        """The ranks' store variables of round ``k``: their key (RESTARTABLE_SECRET, the round's
        own: a value of another launch or round never verifies); with etcd also the
        endpoints (INPROCESS_STORE) and the round's own key namespace (INPROCESS_JOB_ID), so a
        restarted round never reads a key of an earlier one."""
        rs = self.round_sealer(k)
        secret = {} if rs is None else {SECRET_ENV: rs.secret.hex()}
        return {**secret, **self._backend.round_env(k)}

    def delete_job_keys(self) -> None:
        """With etcd: delete every key of the job, all rounds and the launchers' (never
        raises). Node 0 before the job starts; the last launcher out at the end."""
        self._backend.delete_job_keys()

    def request(self, k: int, action: Action) -> Action:
        """Propose what ends round ``k``; returns the action that won (first writer)."""
        key = self._k(f"r{k}/action")
        try:
            self.store.compare_set(key, "", action.to_json())
            return Action.from_json(self.store.get(key).decode())
        except Exception as exc:
            raise store_lost(exc) from exc

    def action(self, k: int) -> Action | None:
        """The action that ends round ``k``, or None while it runs. Raises ``NodeLostError``."""
        key = self._k(f"r{k}/action")
        try:
            return (
                Action.from_json(self.store.get(key).decode()) if self.store.check([key]) else None
            )
        except Exception as exc:
            raise store_lost(exc) from exc

    def report_live(self, k: int, n: int) -> None:
        """Node's processes still running in round ``k`` (live or due for respawn); also this
        launcher's heartbeat. Raises ``NodeLostError`` when the control store is gone."""
        self._liveness.report_live(k, n)

    def gone_nodes(self) -> frozenset[int]:
        """The other launchers that left or stopped beating (``Liveness.gone_nodes``). Raises
        ``NodeLostError`` when the control store is gone (read on every supervisor tick of the
        restart by node: node 0's death must end this node with 75, as ``action`` does)."""
        try:
            return self._liveness.gone_nodes()
        except Exception as exc:
            raise store_lost(exc) from exc

    def job_gone(self, k: int) -> bool:
        """True when every node reported no process left in round ``k``."""
        return self._liveness.job_gone(k)

    def publish_end(self, status: int) -> None:
        """The job ends with ``status`` on this node: publish it (first writer wins; never
        raises) for a killed launcher's ``inprocess.srun_task``."""
        try:
            self.store.compare_set(self._k("end"), "", str(status))
        except Exception as exc:
            log.debug("publishing the end status: %r", exc)

    def leave(self) -> None:
        """This launcher is done (never raises; waits at most ``node_timeout``).

        TCPStore: node 0 waits for the others that are still alive (their beat is fresher than
        ``beat_stale``), so its store outlives every reader. etcd: the last launcher out (every
        other one left, or its beat is stale) deletes every key of the job.
        """
        try:
            self._liveness.mark_left()
            self._backend.leave(self._liveness)
        except Exception as exc:
            log.debug("leaving the control store: %r", exc)

    def close(self) -> None:
        """Drop the stores (node 0: the servers stop; etcd: the clients close)."""
        self._backend.close()
        self._control.close()
