"""Where the launchers' control store and each round's store live: the one interface
``JobControl`` drives (``RoundBackend``), and the choice of the backend, made once by name where
the job starts (``choose_backend``): ``tcp`` (node 0's launcher hosts a TCPStore,
``inprocess.launch.control_tcp``) or ``etcd`` (``--store etcd://...``, nothing hosted,
``inprocess.launch.control_etcd``)."""

from __future__ import annotations

from typing import Protocol

from restartable.checkpoint.sealing import Sealer
from restartable.inprocess.launch.control_store import ControlStore
from restartable.inprocess.launch.liveness import Liveness
from restartable.inprocess.protocol.store import Store


class RoundBackend(Protocol):
    """One backend of the launchers' coordination. Call order: ``open_control()`` once (may
    raise: the job cannot start), ``namespace(launch_id)``; per round ``k``: ``host_round`` (node
    0 creates and publishes what the round needs), the launchers meet, ``join_round`` (everyone
    gets the round's store); at the end ``leave`` (bounded by ``node_timeout``), ``close()``."""

    name: str
    port: int  # the port the ranks of every round get as MASTER_PORT unless a round says another
    node_timeout: float  # the longest wait for another launcher

    def open_control(self) -> Store:
        """The control store, unsealed (node 0 of ``tcp``: the server it starts)."""
        ...

    def namespace(self, launch_id: str) -> str:
        """The prefix of the launch's control keys."""
        ...

    def host_round(self, k: int, control: ControlStore, sealer: Sealer | None) -> None:
        """Before the launchers meet for round ``k``: make its store (and publish its port)."""
        ...

    def join_round(self, k: int, control: ControlStore, sealer: Sealer | None) -> tuple[int, Store]:
        """After they met: round ``k``'s port and this launcher's client of its store."""
        ...

    def round_env(self, k: int) -> dict[str, str]:
        """The store variables of round ``k``'s ranks, beyond their key."""
        ...

    def delete_job_keys(self) -> None:
        """Delete every key of the job, where the backend outlives it (never raises)."""
        ...

    def leave(self, liveness: Liveness) -> None:
        """This launcher marked itself left: wait for, or clean up after, the others."""
        ...

    def close(self) -> None:
        """Drop the stores (servers stop, clients close)."""
        ...


def choose_backend(
    *,
    store_url: str | None,
    job_id: str | None,
    node_rank: int,
    addr: str,
    port: int | None,
    node_timeout: float,
) -> RoundBackend:
    """The backend of this job, by name: ``etcd`` with a ``store_url``, else ``tcp``."""
    name = "tcp" if store_url is None else "etcd"
    if name == "tcp":
        from restartable.inprocess.launch.control_tcp import TcpRounds

        return TcpRounds(node_rank=node_rank, addr=addr, port=port, node_timeout=node_timeout)
    from restartable.inprocess.launch.control_etcd import EtcdRounds  # imports the etcd client

    assert store_url is not None
    return EtcdRounds(
        url=store_url, job_id=job_id, node_rank=node_rank, port=port, node_timeout=node_timeout
    )
