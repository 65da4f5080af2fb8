"""Rank assignment: which initial ranks run ``train()``, which wait as reserves, which left.

Pure functions (no I/O, no torch): every rank computes the same assignment from the same inputs.

Identities: the processes the launcher starts first are initial ranks 0..W-1 (W = WORLD_SIZE).
A process the launcher respawns in the slot of initial rank ``s`` is identity
``respawn_identity(s, generation)`` = ``s + generation * W``: a new reserve slot on the same node
(``node_index``), never confused with a rank that left.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from restartable.inprocess.errors import InprocessError

GRANULARITIES = ("rank", "node")


class NotEnoughRanksError(InprocessError):
    """Fewer healthy ranks remain than ``min_active_world_size``: the job cannot go on."""


@dataclass(frozen=True)
class Assignment:
    """The roles of every initial rank for one restart iteration.

    ``active[i]`` is the initial rank that runs ``train()`` as rank ``i`` (so active ranks are
    always numbered 0..len(active)-1); ``reserve`` holds the healthy ranks that wait, in the order
    they will be activated; ``retired`` holds the ranks that left the job for good. Every initial
    rank is in exactly one of the three.
    """

    active: tuple[int, ...]
    reserve: tuple[int, ...]
    retired: frozenset[int]

    def rank_of(self, initial_rank: int) -> int | None:
        """The rank ``initial_rank`` runs ``train()`` as, or None for a reserve / retired rank."""
        try:
            return self.active.index(initial_rank)
        except ValueError:
            return None

    @property
    def world_size(self) -> int:
        """The number of ranks that run ``train()``."""
        return len(self.active)


def initial_assignment(
    *,
    world_size: int,
    node_of: Sequence[int],
    active_world_size: int | None,
    granularity: str,
) -> Assignment:
    """The first iteration's assignment: initial ranks 0..K-1 active, the rest reserves in order.

    ``node_of[r]`` is the node index of initial rank ``r``; ``active_world_size=None`` means
    every rank is active. Raises ``ValueError`` naming the field for bad input.
    """
    _check_common(world_size=world_size, node_of=node_of, granularity=granularity)
    k = world_size if active_world_size is None else active_world_size
    if not 1 <= k <= world_size:
        raise ValueError(
            f"active_world_size ({active_world_size}) must be between 1 and the number of "
            f"launched ranks ({world_size}): lower active_world_size or launch more ranks"
        )
    return Assignment(
        active=tuple(range(k)), reserve=tuple(range(k, world_size)), retired=frozenset()
    )


def reassign(
    previous: Assignment,
    *,
    node_of: Sequence[int],
    lost: Collection[int],
    demoted: Collection[int] = (),
    joined: Collection[int] = (),
    granularity: str,
    active_world_size: int,
    min_active_world_size: int,
) -> Assignment:
    """The next iteration's assignment after a fault.

    ``lost`` ranks (dead, killed at the hard timeout, unhealthy, over ``max_rank_faults``) are
    retired for good; ``demoted`` ranks move to the back of the reserve pool. With
    ``granularity="node"`` the healthy node-mates of a lost or demoted rank leave the active set
    too (to the back of the reserve pool). Active survivors keep their rank number; reserves
    fill the holes, whole healthy nodes first under node granularity. With fewer than
    ``active_world_size`` ranks available the job shrinks (renumbered 0..n-1, survivors keeping
    their number where it is < n); below ``min_active_world_size`` it raises
    ``NotEnoughRanksError``. ``joined``: respawned identities (``respawn_identity``) that are
    ready to wait as reserves; new ones join the back of the pool, before demoted ranks.
    ``node_of`` lists the node of each initial rank (``node_index`` maps the other identities).
    """
    known = _check_reassign(
        previous,
        node_of=node_of,
        lost=lost,
        demoted=demoted,
        joined=joined,
        granularity=granularity,
        active_world_size=active_world_size,
        min_active_world_size=min_active_world_size,
    )
    retired = previous.retired | frozenset(lost)
    leaving = _leaving(previous, node_of, lost, demoted, known, retired, granularity)

    slots, pool = _slots_and_pool(
        previous, retired=retired, leaving=leaving, joined=joined, size=active_world_size
    )
    active = _fill_holes(slots, pool, node_of, known - retired, leaving, granularity)
    _check_enough(active, retired, active_world_size, min_active_world_size)
    taken = set(active)
    return Assignment(
        active=tuple(active),
        reserve=tuple(r for r in pool if r not in taken),
        retired=retired,
    )


def _fill_holes(
    slots: list[int | None],
    pool: Sequence[int],
    node_of: Sequence[int],
    members: Collection[int],
    leaving: Collection[int],
    granularity: str,
) -> list[int]:
    """``reassign``'s second step: reserves from ``pool`` take the holes of ``slots`` (whole
    healthy nodes first under node granularity, never a node a ``leaving`` rank is on; a node
    is whole when all its ``members`` wait in the pool); with too few, the active set shrinks
    and is renumbered (``_compact``)."""
    holes = [i for i, r in enumerate(slots) if r is None]
    chosen = _pick_reserves(
        pool,
        len(holes),
        node_of=node_of,
        members=members,
        suspect={node_index(r, node_of) for r in leaving},
        granularity=granularity,
    )
    for pos, rank in zip(holes, chosen, strict=False):  # fewer chosen: shrink
        slots[pos] = rank
    return _compact(slots)


def _leaving(
    previous: Assignment,
    node_of: Sequence[int],
    lost: Collection[int],
    demoted: Collection[int],
    known: set[int],
    retired: frozenset[int],
    granularity: str,
) -> set[int]:
    """The healthy ranks that step back to the reserve pool: the demoted ones, and under node
    granularity every healthy rank of a node that lost or demoted one."""
    leaving = set(demoted) - retired
    if granularity == "node":
        # A fault on a node makes the whole node suspect (shared PCIe switch, NIC, host memory):
        # its healthy ranks step back rather than exit, so they can still fill in later.
        bad_nodes = {node_index(r, node_of) for r in (set(lost) - previous.retired) | set(demoted)}
        leaving |= {r for r in known if node_index(r, node_of) in bad_nodes} - retired
    return leaving


def _check_enough(
    active: Sequence[int], retired: Collection[int], active_world_size: int, minimum: int
) -> None:
    if len(active) < minimum:
        raise NotEnoughRanksError(
            f"only {len(active)} healthy rank(s) remain but min_active_world_size is "
            f"{minimum} (active_world_size {active_world_size}, retired ranks "
            f"{sorted(retired)}): launch more ranks as reserves or lower min_active_world_size"
        )


def _slots_and_pool(
    previous: Assignment,
    *,
    retired: frozenset[int],
    leaving: set[int],
    joined: Collection[int],
    size: int,
) -> tuple[list[int | None], list[int]]:
    """``reassign``'s first step: the active places (None: a hole to fill) and the reserve
    pool in the order its ranks are taken."""
    # Ranks beyond the active size (a larger active set earlier) step back to the pool front.
    kept = [r if r not in retired and r not in leaving else None for r in previous.active]
    extra = [r for r in kept[size:] if r is not None]
    slots = kept[:size] + [None] * max(0, size - len(kept))
    # Demoted / excluded ranks go to the back, in initial-rank order so every rank agrees.
    pool = extra + [r for r in previous.reserve if r not in retired and r not in leaving]
    in_job = set(previous.active) | set(previous.reserve)
    pool += sorted(r for r in joined if r not in in_job and r not in retired and r not in leaving)
    pool += sorted(leaving)
    return slots, pool


def _check_reassign(
    previous: Assignment,
    *,
    node_of: Sequence[int],
    lost: Collection[int],
    demoted: Collection[int],
    joined: Collection[int],
    granularity: str,
    active_world_size: int,
    min_active_world_size: int,
) -> set[int]:
    """Validate ``reassign``'s arguments; return every identity the job knows."""
    world_size = len(node_of)
    _check_common(world_size=world_size, node_of=node_of, granularity=granularity)
    if not 1 <= min_active_world_size <= active_world_size:
        raise ValueError(
            f"min_active_world_size ({min_active_world_size}) must be between 1 and "
            f"active_world_size ({active_world_size}): lower min_active_world_size"
        )
    bad_joined = sorted(r for r in joined if r < world_size)
    if bad_joined:
        raise ValueError(
            f"joined ({bad_joined}) holds initial ranks: pass respawned identities (>= "
            f"{world_size}, see respawn_identity)"
        )
    known = (
        set(range(world_size))
        | set(previous.active)
        | set(previous.reserve)
        | previous.retired
        | set(joined)
    )
    for name, ranks in (("lost", lost), ("demoted", demoted)):
        bad = sorted(r for r in ranks if r not in known)
        if bad:
            raise ValueError(
                f"{name} ({bad}) holds ranks that are not in the job (initial ranks "
                f"0..{world_size - 1} or joined identities): pass ranks of the job"
            )
    return known


def respawn_identity(slot: int, generation: int, *, world_size: int) -> int:
    """The identity of the ``generation``-th respawned process in the slot of initial rank
    ``slot`` (generation 0 is the initial process itself)."""
    if not 0 <= slot < world_size or generation < 0:
        raise ValueError(
            f"slot ({slot}) must be in [0, {world_size}) and generation ({generation}) >= 0: "
            "pass the initial rank of the slot and how many times it was respawned"
        )
    return slot + generation * world_size


def node_index(identity: int, node_of: Sequence[int]) -> int:
    """The node of ``identity`` (an initial rank or a respawned identity): its slot's node."""
    return node_of[identity % len(node_of)]


def node_of_ranks(*, world_size: int, local_world_size: int) -> tuple[int, ...]:
    """Node index per initial rank when nodes are consecutive groups of ``local_world_size``."""
    if local_world_size < 1 or world_size % local_world_size:
        raise ValueError(
            f"local_world_size ({local_world_size}) must be >= 1 and divide world_size "
            f"({world_size}): set LOCAL_WORLD_SIZE to the number of ranks per node"
        )
    return tuple(r // local_world_size for r in range(world_size))


def encode_ranks(ranks: Sequence[int]) -> str:
    """``ranks`` in order as comma-separated runs: ``(0, 1, 2, 3, 7, 5, 6)`` -> ``"0-3,7,5-6"``.

    Why: an assignment of a large job is a few runs of consecutive ranks (survivors keep their
    numbers, reserves fill holes), and every rank reads the published decision; as runs its size
    grows with the number of faults, not with the number of ranks. Order is kept (it is the rank
    numbering). Inverse: ``decode_ranks``.
    """
    runs: list[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        runs.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ",".join(runs)


def decode_ranks(text: str) -> tuple[int, ...]:
    """Inverse of ``encode_ranks``; also reads a plain list (``"1,2,3,"``, the older form).

    Raises ``ValueError`` naming the bad part for anything else.
    """
    out: list[int] = []
    for lo, hi in parse_runs(text):
        out.extend(range(lo, hi + 1))
    return tuple(out)


def parse_runs(text: str) -> list[tuple[int, int]]:
    """The runs of ``encode_ranks``' form as inclusive ``(first, last)`` pairs, not expanded
    (``rank_runs``); ``ValueError`` naming the bad part, as ``decode_ranks``."""
    out: list[tuple[int, int]] = []
    for part in text.split(","):
        if not part:
            continue
        first, sep, last = part.partition("-")
        try:
            lo, hi = int(first), int(last) if sep else int(first)
        except ValueError:
            raise ValueError(
                f"rank list {text!r}: part {part!r} is neither a rank nor a run 'a-b'"
            ) from None
        if hi < lo:
            raise ValueError(f"rank list {text!r}: run {part!r} ends before it starts")
        out.append((lo, hi))
    return out


def _pick_reserves(
    pool: Sequence[int],
    wanted: int,
    *,
    node_of: Sequence[int],
    members: Collection[int],
    suspect: Collection[int],
    granularity: str,
) -> list[int]:
    """Up to ``wanted`` ranks from the front of ``pool``; whole healthy nodes first for "node".

    ``members``: every rank of the job that is not retired; a node is whole when all of its
    members wait in the pool (a node whose lost rank was respawned is whole again).
    ``suspect`` nodes (a rank of theirs just faulted or stepped back) are never taken whole.
    """
    if granularity == "rank" or wanted == 0:
        return list(pool[:wanted])
    groups: dict[int, list[int]] = {}
    for r in pool:
        groups.setdefault(node_index(r, node_of), []).append(r)
    node_size: dict[int, int] = {}
    for r in members:
        n = node_index(r, node_of)
        node_size[n] = node_size.get(n, 0) + 1
    chosen: list[int] = []
    # First pass: complete nodes (every rank of the node healthy and waiting) that still fit.
    for node, ranks in groups.items():
        whole = len(ranks) == node_size[node] and node not in suspect
        if whole and len(chosen) + len(ranks) <= wanted:
            chosen += ranks
    # Second pass: no whole node fits any more; take single ranks front first rather than shrink.
    for r in pool:
        if len(chosen) == wanted:
            break
        if r not in chosen:
            chosen.append(r)
    return chosen


def _compact(slots: list[int | None]) -> list[int]:
    """Close remaining holes: the highest-numbered ranks move into them (the rest keep theirs)."""
    n = sum(r is not None for r in slots)
    tail = [r for r in slots[n:] if r is not None]
    return [r if r is not None else tail.pop() for r in slots[:n]]


def _check_common(*, world_size: int, node_of: Sequence[int], granularity: str) -> None:
    if world_size < 1:
        raise ValueError(f"world_size ({world_size}) must be >= 1: launch at least one rank")
    if len(node_of) != world_size:
        raise ValueError(
            f"node_of has {len(node_of)} entries but world_size is {world_size}: give one node "
            "index per initial rank"
        )
    if granularity not in GRANULARITIES:
        raise ValueError(
            f"granularity ({granularity!r}) must be one of {GRANULARITIES}: use 'rank' to "
            "retire only the faulty rank or 'node' to retire its whole node"
        )
