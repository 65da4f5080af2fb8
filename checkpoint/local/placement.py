"""Pure replica placement and restore planning for the local tier (no I/O, no collectives).

`nodes[r]` is the node index of the process that is rank r now (after an in-process restart a
reserve from another node may play rank r). A shard saved by rank r is held by r and by one rank
on each of the next `replication_factor - 1` nodes (in order of first appearance), so losing any
`replication_factor - 1` nodes loses no shard.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from restartable.checkpoint.local.leaf import Leaf

ShardId = tuple[int, int]  # (step, owner rank at save time)


def node_indices(keys: Sequence[Hashable]) -> list[int]:
    """Node index per rank from any per-rank node key (hostname, ...), by first appearance."""
    seen: dict[Hashable, int] = {}
    return [seen.setdefault(k, len(seen)) for k in keys]


def num_nodes(nodes: Sequence[int]) -> int:
    return len(set(nodes))


def effective_factor(nodes: Sequence[int], factor: int) -> int:
    """The replication factor that fits: at most one copy per node."""
    return max(1, min(factor, num_nodes(nodes)))


def placement(nodes: Sequence[int], factor: int) -> list[list[int]]:
    """For every owner rank, the ranks (other than itself) that receive a replica of its shard.

    The k-th replica goes to node (owner's node + k), to the rank there whose position on its
    node matches the owner's position on its own (modulo the node's size), which spreads the
    replicas of one node's ranks over the ranks of the next nodes. O(world x factor).
    """
    members: dict[int, list[int]] = {}
    for r, n in enumerate(nodes):
        members.setdefault(n, []).append(r)
    order = {n: i for i, n in enumerate(members)}
    node_list = list(members)
    f = effective_factor(nodes, factor)
    out: list[list[int]] = [[] for _ in nodes]
    for node, ranks in members.items():
        here = order[node]
        for pos, owner in enumerate(ranks):
            for k in range(1, f):
                there = members[node_list[(here + k) % len(node_list)]]
                out[owner].append(there[pos % len(there)])
    return out


def received_from(plan: Sequence[Sequence[int]]) -> list[list[int]]:
    """The inverse of `placement`: for every rank, the owners whose replica it receives."""
    out: list[list[int]] = [[] for _ in plan]
    for owner, hs in enumerate(plan):
        for h in hs:
            out[h].append(owner)
    return out


@dataclass(frozen=True)
class RestorePlan:
    """Step to restore and, per rank role, the rank that provides that role's shard."""

    step: int
    sources: tuple[int, ...]  # sources[r] = rank that holds shard (step, r); r itself if local


def plan_restore(
    world: int,
    inventories: Sequence[Iterable[ShardId]],
    *,
    min_step: int | None,
    bad: Iterable[tuple[int, int, int]] = (),
) -> RestorePlan | None:
    """The newest step >= min_step whose every shard some rank can provide, and who provides it.

    `inventories[h]` lists the shards rank h holds; `bad` holds (step, owner, holder) triples
    that failed verification and must not be used again. A rank that holds its own shard serves
    itself (no transfer); otherwise the holder with the fewest assignments so far serves it
    (spreads the sending load), ties to the lowest rank. Deterministic: every rank computes the
    same plan from the same inputs.
    """
    excluded = set(bad)
    held: dict[ShardId, list[int]] = {}
    for h, inv in enumerate(inventories):
        for sid in inv:
            if (sid[0], sid[1], h) not in excluded:
                held.setdefault(sid, []).append(h)
    steps = sorted({s for s, _ in held}, reverse=True)
    for step in steps:
        if min_step is not None and step < min_step:
            break
        sources: list[int] = []
        load = [0] * world
        for owner in range(world):
            hs = held.get((step, owner), [])
            if not hs:
                break
            if owner in hs:
                src = owner
            else:
                src = min(hs, key=lambda h: (load[h], h))
                load[src] += 1
            sources.append(src)
        else:
            return RestorePlan(step, tuple(sources))
    return None


def assign_replicated(sizes: Sequence[tuple[str, int]], world: int) -> dict[str, int]:
    """fully_parallel: the rank that keeps each replicated tensor, balancing bytes.

    Largest first onto the least-loaded rank (ties: lowest rank); key order breaks size ties, so
    the assignment depends only on the keys, sizes and world size.
    """
    load = [0] * world
    out: dict[str, int] = {}
    for key, nbytes in sorted(sizes, key=lambda kv: (-kv[1], kv[0])):
        r = min(range(world), key=lambda i: (load[i], i))
        out[key] = r
        load[r] += nbytes
    return out


def node_key() -> str:
    """This process's node: its host, and its node index at launch (so ranks simulated as
    several nodes on one machine count as different nodes): INPROCESS_LAUNCH_GROUP_RANK, which
    inprocess sets once it renumbered RANK / LOCAL_WORLD_SIZE for a restart iteration, else
    RANK // LOCAL_WORLD_SIZE when both are set."""
    key = socket.gethostname()
    launch_node = os.environ.get("INPROCESS_LAUNCH_GROUP_RANK", "")
    if launch_node.isdigit():
        return f"{key}/{int(launch_node)}"
    rank, lws = os.environ.get("RANK"), os.environ.get("LOCAL_WORLD_SIZE")
    if rank and lws and rank.isdigit() and lws.isdigit() and int(lws) > 0:
        key += f"/{int(rank) // int(lws)}"
    return key


def replicated_owner(tensors: list[Leaf], world: int) -> dict[str, int]:
    """fully_parallel: the rank that keeps each tensor under a ReplicatedState."""
    rep = [(x.key, x.value.numel() * x.value.element_size()) for x in tensors if x.replicated]
    return assign_replicated(rep, world)
