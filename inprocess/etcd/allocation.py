"""The etcd cluster of one Slurm allocation, planned: which nodes run a member, their addresses,
ports and command lines, the store URL, and what the size survives (pure: only name lookups)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

from restartable.inprocess.errors import ConfigError

ETCD_BIN = "/usr/bin/etcd"  # Debian's etcd-server
INSTALL_HINT = "ETCD=1 needs /usr/bin/etcd on every node: apt-get install etcd-server"
# etcd's own defaults (ms): a lost leader is replaced in about one election timeout. The tests'
# clusters run them too (etcd_argv): on a heavily loaded CI machine shorter ones caused leader
# churn.
HEARTBEAT_MS = 100
ELECTION_MS = 1000
MAX_MEMBERS = 5  # more members only slow every write down: 5 survive the loss of 2 nodes


def default_members(nnodes: int) -> int:
    """How many of ``nnodes`` nodes run a member: every node up to 3, then an odd count (an
    even one survives no more losses than the odd one below it), at most ``MAX_MEMBERS``."""
    if nnodes < 1:
        raise ConfigError(f"the allocation has {nnodes} nodes: etcd needs at least one")
    if nnodes <= 3:
        return nnodes
    return 3 if nnodes == 4 else MAX_MEMBERS


def tolerated_losses(members: int) -> int:
    """Members that may be lost while the rest still form a majority (etcd keeps answering)."""
    return (members - 1) // 2


def sizing_warning(members: int) -> str | None:
    """The warning for a cluster that cannot lose a member (fewer than three), else None."""
    if members >= 3:
        return None
    if members == 1:
        return (
            "etcd in the allocation: 1 member, on the first node: losing that node loses the "
            "store and ends the job (as the default store hosted by node 0 would): the job needs "
            "3 or more nodes to survive the loss of one"
        )
    return (
        "etcd in the allocation: 2 members cannot lose either (each write needs both): losing "
        "either node stops the store and ends the job; the job needs 3 or more nodes to "
        "survive the loss of one"
    )


@dataclass(frozen=True)
class AllocationCluster:
    """``nodes`` (Slurm node names, in order) each run one member, listening on the address its
    name resolves to (the node's own): clients on ``port``, peers on ``port + 1``."""

    nodes: tuple[str, ...]
    addresses: tuple[str, ...]
    port: int

    @classmethod
    def resolve(cls, nodes: list[str], port: int) -> AllocationCluster:
        """Look up every node's address; ``ConfigError`` naming a node that does not resolve,
        a port out of range, or no node."""
        if not os.access(ETCD_BIN, os.X_OK):
            raise ConfigError(f"{ETCD_BIN} is not an executable here: {INSTALL_HINT}")
        if not nodes:
            raise ConfigError("--nodes names no node: pass the allocation's nodes, n1,n2,n3")
        if not 0 < port < 65535:
            raise ConfigError(
                f"--port ({port}) must be in 1..65534 (the peers use port + 1): pick a free one"
            )
        addresses = []
        for node in nodes:
            try:
                addresses.append(socket.gethostbyname(node))
            except OSError as exc:
                raise ConfigError(
                    f"node {node!r} does not resolve to an address ({exc}): the etcd members "
                    "listen on the nodes' own addresses, so every node name must resolve"
                ) from None
        return cls(tuple(nodes), tuple(addresses), port)

    @property
    def peer_port(self) -> int:
        return self.port + 1

    def endpoint(self, node: str) -> str:
        return f"{self.addresses[self.nodes.index(node)]}:{self.port}"

    def url(self) -> str:
        """The store URL the launchers and ranks take (``INPROCESS_STORE``)."""
        return "etcd://" + ",".join(self.endpoint(n) for n in self.nodes)

    def member_argv(self, node: str, *, data_dir: Path, token: str) -> list[str]:
        """The command line of ``node``'s member (``ConfigError`` when it is not one)."""
        if node not in self.nodes:
            raise ConfigError(
                f"node {node!r} is not one of the etcd members {','.join(self.nodes)}: run the "
                "member only on those nodes (srun --nodelist)"
            )
        addr = self.addresses[self.nodes.index(node)]
        return etcd_argv(
            node,
            client=f"http://{addr}:{self.port}",
            peers={
                n: f"http://{a}:{self.peer_port}"
                for n, a in zip(self.nodes, self.addresses, strict=True)
            },
            data_dir=data_dir,
            token=token,
            log_level="error",  # a lost peer is expected here: no warning per retry
        )


def etcd_argv(
    name: str,
    *,
    client: str,
    peers: dict[str, str],
    data_dir: Path,
    token: str,
    log_level: str,
    etcd_bin: str = ETCD_BIN,
) -> list[str]:
    """The command line of member ``name`` of a new cluster: clients at the URL ``client``,
    every member's peer URL in ``peers`` (``name``'s own included), Raft at etcd's default
    timings (``HEARTBEAT_MS``, ``ELECTION_MS``). The allocation's members and the tests' run it."""
    return [
        etcd_bin,
        f"--name={name}",
        f"--data-dir={data_dir}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peers[name]}",
        f"--initial-advertise-peer-urls={peers[name]}",
        f"--initial-cluster={','.join(f'{n}={url}' for n, url in peers.items())}",
        "--initial-cluster-state=new",
        f"--initial-cluster-token={token}",
        f"--heartbeat-interval={HEARTBEAT_MS}",
        f"--election-timeout={ELECTION_MS}",
        "--logger=zap",
        f"--log-level={log_level}",
    ]
