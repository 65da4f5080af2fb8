"""The rank's side of the restart by node (``inprocess.launch --restart-by node``): where the
launcher passes ``RESTARTABLE_NODE_STORE``, the restart loop announces each iteration on the
node's own store and meets at ``node_barrier.node_restart_barrier`` instead of the per-rank
barrier (``restart_meeting``). Without the variable (plain torchrun, srun) ``from_environ``
returns None and nothing changes."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

from restartable.checkpoint.sealing import Sealer
from restartable.inprocess.clock import SYSTEM, Clock
from restartable.inprocess.errors import ConfigError, FaultRecord
from restartable.inprocess.protocol import node_barrier
from restartable.inprocess.protocol.environment import LaunchEnv
from restartable.inprocess.protocol.sealed_store import seal
from restartable.inprocess.protocol.store import Store
from restartable.inprocess.protocol.tcpstore_client import TCPStoreClient


class NodePath:
    """This rank's node-local store client and the node layout (identity -> node:
    ``(identity % world_size) // local_world_size``, respawned identities included)."""

    def __init__(
        self,
        local: Store,
        *,
        node: int,
        world_size: int,
        local_world_size: int,
        clock: Clock,
        new_client: Callable[[], Store] | None = None,
    ) -> None:
        self.local, self.node, self.clock = local, node, clock
        self._w, self._n = world_size, local_world_size
        self._new_client = new_client

    def new_client(self) -> Store:
        """Another client of the node store, for a blocking wait of its own: each iteration's
        monitor waits there for the iteration's end, which the relay copies from the job's
        store (one job-store wait per node instead of one per rank)."""
        if self._new_client is None:
            raise ConfigError(
                "this NodePath was built on a store client alone (a test's): give it "
                "new_client= to open the monitors' clients"
            )
        return self._new_client()

    @classmethod
    def from_environ(
        cls,
        environ: Mapping[str, str],
        *,
        rank: int,
        world_size: int,
        local_world_size: int,
        timeout: float,
        clock: Clock = SYSTEM,
        sealer: Callable[[], Sealer | None] = lambda: None,
    ) -> NodePath | None:
        """The node path when ``RESTARTABLE_NODE_STORE`` is set (``host:port``), else None.
        ``sealer``: the job's (the launcher's relay seals with the same key), so that a value
        another local user writes on the node store is refused as on the job's store; called
        only where the variable is set (without a launcher a job's secret may not exist yet)."""
        raw = environ.get(node_barrier.NODE_STORE_ENV)
        if not raw:
            return None
        host, _, port = raw.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(
                f"{node_barrier.NODE_STORE_ENV}={raw!r}: expected host:port (the launcher's "
                "node store); unset it to use the per-rank restart path"
            )

        key = sealer()

        def open_client() -> Store:
            return seal(TCPStoreClient(host, int(port), timeout=timeout, clock=clock), key)

        return cls(
            open_client(),
            node=rank // local_world_size,
            world_size=world_size,
            local_world_size=local_world_size,
            clock=clock,
            new_client=open_client,
        )

    @classmethod
    def of_rank(
        cls,
        environ: Mapping[str, str],
        env: LaunchEnv,
        timeout: float,
        clock: Clock = SYSTEM,
        sealer: Callable[[], Sealer | None] = lambda: None,
    ) -> NodePath | None:
        """``from_environ`` for the rank ``env`` describes (the restart loop's)."""
        return cls.from_environ(
            environ,
            rank=env.rank,
            world_size=env.world_size,
            local_world_size=env.local_world_size,
            timeout=timeout,
            clock=clock,
            sealer=sealer,
        )

    def node_of(self, identity: int) -> int:
        return (identity % self._w) // self._n

    def members(self, participants: Collection[int]) -> tuple[int, ...]:
        """The participants that run on this node."""
        return tuple(sorted(p for p in participants if self.node_of(p) == self.node))

    def announce(self, iteration: int, participants: Collection[int]) -> None:
        """The start of ``iteration``: this node's members and the participating nodes."""
        members = self.members(participants)
        if members:
            nodes = len({self.node_of(p) for p in participants})
            node_barrier.start_node_iteration(self.local, iteration, members=members, nodes=nodes)

    def restart_barrier(
        self,
        job: Store,
        iteration: int,
        *,
        initial_rank: int,
        participants: Collection[int],
        decide: Callable[[list[FaultRecord]], str],
        timeout: float,
        clock: Clock = SYSTEM,
    ) -> str:
        """``node_barrier.node_restart_barrier`` for this rank; the published decision."""
        return node_barrier.node_restart_barrier(
            self.local,
            job,
            iteration,
            initial_rank=initial_rank,
            members=self.members(participants),
            decide=decide,
            timeout=timeout,
            clock=clock,
        )
