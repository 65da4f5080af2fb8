"""Pure replica placement and restore planning for the local tier (no I/O, no collectives).

Nodes are groups of `local_world_size` consecutive ranks. A shard saved by rank r is held by r and
by the ranks with r's local rank on the next `replication_factor - 1` nodes, so losing any
`replication_factor - 1` nodes loses no shard.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

ShardId = tuple[int, int]  # (step, owner rank at save time)


def num_nodes(world: int, local_world_size: int) -> int:
    return max(1, world // max(1, local_world_size))


def effective_factor(world: int, local_world_size: int, factor: int) -> int:
    """The replication factor that fits: at most one copy per node."""
    return max(1, min(factor, num_nodes(world, local_world_size)))


def holders(owner: int, world: int, local_world_size: int, factor: int) -> list[int]:
    """Ranks (other than `owner`) that receive a replica of `owner`'s shard."""
    f = effective_factor(world, local_world_size, factor)
    return [(owner + k * local_world_size) % world for k in range(1, f)]


def owners_held_by(rank: int, world: int, local_world_size: int, factor: int) -> list[int]:
    """Owners whose shard `rank` receives a replica of (the inverse of `holders`)."""
    f = effective_factor(world, local_world_size, factor)
    return [(rank - k * local_world_size) % world for k in range(1, f)]


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
