"""The launcher's side of the restart by node (``--restart-by node``): per round, a store on
127.0.0.1 for this node's ranks (``node_barrier``'s node-local store) and one ``NodeRelay``
thread that speaks to the job's store for them, iteration after iteration, until the round
ends. The ranks find the local store in ``RESTARTABLE_NODE_STORE`` (``env``)."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Collection, Mapping

from restartable.checkpoint.sealing import Sealer
from restartable.inprocess.clock import SYSTEM, Clock
from restartable.inprocess.launch.node_deaths import ReportedDeaths
from restartable.inprocess.protocol.node_barrier import NODE_STORE_ENV
from restartable.inprocess.protocol.node_relay import NodeRelay, RelaySources
from restartable.inprocess.protocol.sealed_store import seal
from restartable.inprocess.protocol.store import Store
from restartable.inprocess.protocol.tcpstore_client import TCPStoreClient
from restartable.inprocess.store_server import listening_server

log = logging.getLogger(__name__)

RESTART_BY = ("rank", "node")  # --restart-by's values; "rank": no local store, no relay
SLICE_S = 1.0  # the relay's job client timeout: how often a blocked get re-checks / stops
# The relay's clients' bound to connect and for each answer (not SLICE_S: a store server slow
# under load would fail a launcher's round at its first connection, as a 5 s connect failed a
# test under CI load); the blocking gets keep their SLICE_S.
CONNECT_TIMEOUT_S = 30.0


class NodeHost:
    """Round ``round_``'s local store and relay on node ``node``.

    ``job_addr``/``job_port``: the round's job store on the TCPStore (the relay opens a client
    of its own, sealed with ``sealer`` as the ranks' values are); ``job_store``: instead, the
    relay's own client of the round's job store on etcd (``etcd_job_client``), timeout
    ``SLICE_S``, unsealed (sealed here). ``dead_local`` (the node's ranks whose
    process exited: counted dead once reported, ``node_deaths``) / ``gone_nodes``: the relay's
    ``RelaySources``. ``barrier_timeout``: the bound of one restart at the relay.
    ``close()`` stops the relay (within one slice) and the local store."""

    def __init__(
        self,
        *,
        node: int,
        round_: int,
        job_addr: str,
        job_port: int,
        sealer: Sealer | None,
        dead_local: Callable[[], Collection[int]],
        gone_nodes: Callable[[], Collection[int]],
        barrier_timeout: float,
        clock: Clock = SYSTEM,
        job_store: Store | None = None,
    ) -> None:
        self.node, self.round, self._timeout, self._clock = node, round_, barrier_timeout, clock
        self._server = listening_server("127.0.0.1", 0, wait_for_workers=False, use_libuv=True)
        self.port = int(self._server.port)
        # Sealed as the ranks' client is (``NodePath``): the node store listens on 127.0.0.1,
        # where any local user may connect; a value without the job's seal is refused.
        local = _client("127.0.0.1", self.port, clock)
        self._local = seal(local, sealer)
        raw = job_store or _client(job_addr, job_port, clock)
        job = seal(raw, sealer)
        self._job, self._job_raw = job, raw
        # A child that exited counts once its watchdog's report is in (``node_deaths``).
        self._deaths = ReportedDeaths(job, dead_local, clock=clock)
        sources = RelaySources(dead_local=self._deaths, gone_nodes=gone_nodes)
        self._relay = NodeRelay(job, self._local, node=node, sources=sources, clock=clock)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._serve, name=f"node-relay-r{round_}", daemon=True
        )
        self._thread.start()
        # DEBUG: the default path of every launch; a restart's line below is the one a user
        # sees (the quick start's output is the script's own lines and nothing else).
        log.debug(
            "node %d round %d: node store on 127.0.0.1:%d, relay started", node, round_, self.port
        )

    def env(self) -> dict[str, str]:
        """The ranks' variable naming the local store."""
        return {NODE_STORE_ENV: f"127.0.0.1:{self.port}"}

    def _serve(self) -> None:
        iteration = 0
        try:
            while not self._stop.is_set():
                outcome = self._relay.serve(
                    iteration, timeout=self._timeout, stop=self._stop.is_set
                )
                if outcome is None or outcome != "fault":
                    log.debug(
                        "node %d relay: iteration %d %s",
                        self.node,
                        iteration,
                        "not ended: the round stops" if outcome is None else f"ended ({outcome})",
                    )
                    return
                log.info("node %d relay: restart after iteration %d relayed", self.node, iteration)
                iteration += 1
        except Exception as exc:  # the ranks' own barrier timeout then names the wait
            if not self._stop.is_set():
                log.warning("node %d relay stopped at iteration %d: %r", self.node, iteration, exc)

    def close(self) -> None:
        """Stop the relay (it sees ``stop`` within one slice) and drop the clients (idempotent)."""
        self._stop.set()
        self._thread.join(SLICE_S * 3)
        if self._thread.is_alive():
            log.warning(
                "node %d relay still blocked after %.1f s: left behind", self.node, SLICE_S * 3
            )
            return
        close = getattr(self._job_raw, "close", None)  # an etcd client's HTTP connections
        if close is not None:
            with contextlib.suppress(Exception):
                close()


def _client(host: str, port: int, clock: Clock) -> TCPStoreClient:
    return TCPStoreClient(
        host, port, timeout=SLICE_S, connect_timeout=CONNECT_TIMEOUT_S, clock=clock
    )


def etcd_job_client(round_env: Mapping[str, str]) -> Store:
    """The relay's client of a round's job store on etcd: the namespace the round's ranks
    open (``round_env``: ``JobControl.round_store_env``'s INPROCESS_STORE and
    INPROCESS_JOB_ID), a blocking get re-armed every ``SLICE_S``."""
    from restartable.inprocess.etcd.connect import open_store

    url, job_id = round_env["INPROCESS_STORE"], round_env["INPROCESS_JOB_ID"]
    return open_store(url, job_id=job_id, timeout=SLICE_S, connect_timeout=CONNECT_TIMEOUT_S)
