"""The ranks of the local tier's dedicated group as its saves see them: the group contract, each
rank's node (gathered once per group) and which saves agree on the completed steps."""

from __future__ import annotations

from typing import Any, Protocol

import torch.distributed as dist

from restartable.checkpoint.exchange import Attempts, StoreExchange
from restartable.checkpoint.local import placement
from restartable.checkpoint.local.background import AGREE_EVERY


class GroupSource(Protocol):
    """What the tier needs from checkpoint.group.BackgroundGroup."""

    def current(self) -> dist.ProcessGroup | None: ...

    def is_stale(self) -> bool: ...

    def drop(self) -> None: ...

    @property
    def generation(self) -> int: ...

    @property
    def token(self) -> str | None: ...


class Peers:
    """Per-group facts of one ``LocalTier``, kept across saves and renewed with the group.

    Training thread only, called by ``LocalTier.save`` with the group it just got from
    ``group.current()``. ``node_indices`` is COLLECTIVE the first time over a group (an
    all_gather_object); ``next_agreement`` never blocks.
    """

    def __init__(self, group: GroupSource, *, timeout: float) -> None:
        self._group = group
        self._node = placement.node_key()
        # Per dedicated group, keyed by its generation: holding the group object itself would keep
        # a destroyed group's sockets open after a restart.
        self._nodes: tuple[tuple[bool, int], list[int]] | None = None
        self._attempts = Attempts("local", timeout=timeout)
        self._saves: tuple[str | None, int] = (None, 0)  # (group token, saves over it)

    def next_agreement(
        self, pg: dist.ProcessGroup | None
    ) -> tuple[StoreExchange, StoreExchange | None] | None:
        """The store exchange of this save's agreement, on every AGREE_EVERY-th save over a
        group (its first included), else None. The count is the same on every rank: saves are
        collective, and a new group (a restart) starts every rank's count again."""
        if pg is None or dist.get_world_size(pg) == 1:
            return None
        token = self._group.token
        count = self._saves[1] + 1 if self._saves[0] == token else 1
        self._saves = (token, count)
        if (count - 1) % AGREE_EVERY != 0:
            return None
        return self._attempts.next(pg, token)

    def node_indices(self, pg: dist.ProcessGroup | None) -> list[int]:
        """Node index of every rank of `pg` (COLLECTIVE once per group, then cached).

        Gathered, not derived from the rank: after an in-process restart a reserve from another
        node may play any rank, and a replica must never land on the owner's own node.
        """
        key = (pg is None, self._group.generation)
        if self._nodes is not None and self._nodes[0] == key:
            return self._nodes[1]
        keys: list[Any] = [self._node]
        if pg is not None:
            keys = [None] * dist.get_world_size(pg)
            dist.all_gather_object(keys, self._node, group=pg)
        nodes = placement.node_indices(keys)
        self._nodes = (key, nodes)
        return nodes
