"""Where each iteration's process group meets: the coordination store, or a group-hosted one.

c10d's rendezvous (``init_process_group`` over a store) is a burst of small blocking calls: each
rank sets its address, then waits for and reads every peer's. On the launcher's TCPStore that is
a fraction of a millisecond per call; on etcd every call is a consensus round trip (measured
with 3 ranks: 7 calls in a row, 40-60 ms of a 250 ms restart). So on etcd the group's rank 0
hosts a small TCPStore for the rendezvous of the iterations it leads, as torchrun's rank 0
does, and publishes its address through etcd. That adds no single point of failure: if the
host dies, its iteration fails anyway (its group lost a member), the clients see the closed
connection at once, and the next iteration's rank 0 is another live process. Everything else
(barriers, decisions, fault records, ``ctx.store``) stays on etcd.

The restart loop owns one ``Rendezvous`` per process and calls, per iteration of an active
rank, ``prepare(host)`` before the join barrier (the host publishes its address, so that it is
there once the barrier releases the others) and ``store(host)`` after it; ``close()`` at the
end. All of them run on the main thread.
"""

from __future__ import annotations

import datetime
import logging
import socket
from typing import Any

import torch.distributed as dist

from restartable.inprocess.protocol.keys import ROOT
from restartable.inprocess.protocol.sealed_store import unsealed
from restartable.inprocess.store_server import listening_server

log = logging.getLogger(__name__)

_ADDRESS_KEY = ROOT + "rendezvous/"  # + the host's identity: "host:port"


def advertised_host(endpoints: tuple[tuple[str, int], ...]) -> str:
    """The address of this machine that peers can reach: the one it uses to reach etcd.

    A UDP "connect" sends nothing; it only asks the kernel for the route, so the answer is the
    interface facing the coordination network (127.0.0.1 when etcd is on loopback).
    """
    host, port = endpoints[0]
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            return str(s.getsockname()[0])
    except OSError:
        return socket.getfqdn()


class Rendezvous:
    """The store that iteration groups are created over (see the module docstring).

    ``hosted``: False on the TCPStore (``store()`` is the coordination store itself); True on
    etcd, with ``advertise`` the address this process's server is reachable at.
    """

    def __init__(
        self, coordination: Any, *, me: int, hosted: bool, advertise: str, timeout: float
    ) -> None:
        self._coordination = coordination
        self._me = me
        self._hosted = hosted
        self._advertise = advertise
        self._timeout = datetime.timedelta(seconds=timeout)
        self._server: dist.TCPStore | None = None
        self._clients: dict[int, dist.TCPStore] = {}  # host identity -> connected client

    @property
    def hosted(self) -> bool:
        """True on etcd: groups meet on a store hosted by their rank 0."""
        return self._hosted

    def prepare(self, host: int) -> None:
        """Before the join barrier of an iteration whose group rank 0 is ``host``: if that is
        this process, start its server (once) and publish the address (one store call)."""
        if not self._hosted or host != self._me or self._server is not None:
            return
        self._server = listening_server(
            self._advertise, 0, wait_for_workers=False, timeout=self._timeout
        )
        where = f"{self._advertise}:{self._server.port}"
        self._coordination.set(f"{_ADDRESS_KEY}{self._me}", where)
        log.debug("rank %d hosts group rendezvous at %s", self._me, where)

    def store(self, host: int) -> Any:
        """The store for the group whose rank 0 is ``host`` (after the join barrier).

        Blocks at most ``timeout`` for the host's address (published before it joined, so
        normally present) and to connect; a client is kept per host across iterations.
        """
        if not self._hosted:  # torch's own values: the client under the sealed one
            return unsealed(self._coordination)
        if host == self._me:
            assert self._server is not None, "prepare(host) was not called"
            return self._server
        client = self._clients.get(host)
        if client is None:
            where = self._coordination.get(f"{_ADDRESS_KEY}{host}").decode()
            addr, _, port = where.rpartition(":")
            client = dist.TCPStore(
                addr.strip("[]"), int(port), is_master=False, timeout=self._timeout
            )
            self._clients[host] = client
        return client

    def forget(self, host: int) -> None:
        """Drop the client of ``host`` (its group failed: the host may be gone)."""
        self._clients.pop(host, None)

    def close(self) -> None:
        """Release the clients and stop this process's server (end of the job)."""
        self._clients.clear()
        self._server = None
