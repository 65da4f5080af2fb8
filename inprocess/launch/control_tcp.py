"""The ``tcp`` backend of the launchers' coordination (``RoundBackend``): node 0's launcher hosts
the control store, a TCPStore on ``--master-port``, for the whole job, outside every training
process (losing any rank loses no coordination state). Round 0's ranks use that server too;
every later round gets a fresh server on a free port, published under ``<ns>r{k}/port``, so no
key of an earlier round is ever read again."""

from __future__ import annotations

import datetime

import torch.distributed as dist

from restartable.checkpoint.sealing import Sealer
from restartable.inprocess.launch.control_store import ControlStore
from restartable.inprocess.launch.liveness import Liveness
from restartable.inprocess.launch.node_lost import store_lost
from restartable.inprocess.protocol.sealed_store import seal
from restartable.inprocess.protocol.store import Store, as_store
from restartable.inprocess.store_server import listening_server

_PORT_WAIT_S = 30.0  # how long a launcher waits for node 0's round port once all arrived


class TcpRounds:
    """Node 0 hosts; the other launchers connect to ``addr:port`` (``--master-addr/-port``)."""

    name = "tcp"

    def __init__(self, *, node_rank: int, addr: str, port: int | None, node_timeout: float) -> None:
        self.node_rank, self.addr, self.node_timeout = node_rank, addr, node_timeout
        self._requested = port
        self.port = port or 0  # node 0: the port its server listens on, once started
        self._control: dist.TCPStore | None = None  # the server (node 0) or a client of it
        # Node 0: the round servers it hosts; dropping one stops it (the previous round's).
        self._rounds: dict[int, Store] = {}
        self._ports: dict[int, int] = {}

    def open_control(self) -> Store:
        if self.node_rank == 0:
            # Outside every training process: losing any rank loses no coordination state.
            server = listening_server(
                self.addr, self._requested or 0, wait_for_workers=False, use_libuv=True
            )
            self.port = int(server.port)  # the port this server was started with
            self._control = server
        else:
            assert self._requested is not None
            try:
                self._control = _client(self.addr, self._requested, self.node_timeout)
            except Exception as exc:
                raise store_lost(exc) from exc
        return as_store(self._control)

    def namespace(self, launch_id: str) -> str:
        return "launch/"

    def host_round(self, k: int, control: ControlStore, sealer: Sealer | None) -> None:
        if self.node_rank != 0:
            return
        if k == 0:  # round 0's ranks use the control store's server
            assert self._control is not None
            store, port = seal(self._control, sealer), self.port
        else:
            server = listening_server(self.addr, 0, wait_for_workers=False, use_libuv=True)
            store, port = seal(server, sealer), int(server.port)
        # The previous round's processes are gone; its store goes (round 0's is the control).
        self._rounds.pop(k - 1, None)
        self._rounds[k], self._ports[k] = store, port
        control.store.set(control.key(f"r{k}/port"), str(port))

    def join_round(self, k: int, control: ControlStore, sealer: Sealer | None) -> tuple[int, Store]:
        if self.node_rank == 0:
            return self._ports[k], self._rounds[k]
        key = control.key(f"r{k}/port")
        control.store.wait([key], datetime.timedelta(seconds=_PORT_WAIT_S))
        port = int(control.store.get(key))
        assert self._control is not None
        raw = self._control if k == 0 else _client(self.addr, port, _PORT_WAIT_S)
        return port, seal(raw, sealer)

    def round_env(self, k: int) -> dict[str, str]:
        return {}  # MASTER_ADDR / MASTER_PORT name the round's server

    def delete_job_keys(self) -> None:
        pass  # the server's keys go with it

    def leave(self, liveness: Liveness) -> None:
        # Node 0's store must outlive every launcher that still reads it.
        if self.node_rank == 0:
            liveness.wait_for_others()

    def close(self) -> None:
        self._rounds.clear()
        self._control = None


def _client(addr: str, port: int, timeout: float) -> dist.TCPStore:
    return dist.TCPStore(
        addr,
        port,
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout),
        wait_for_workers=False,
    )
