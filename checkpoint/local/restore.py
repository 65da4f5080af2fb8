"""Collective restore of the local tier: agree on a step, fetch each rank's shard, verify, fill.

Called by LocalTier.load() on every rank of the current world, on the tier's gloo group. Sources
in order of preference: own memory (a memcpy, no file read, trusted: this process wrote it),
own node-local directory, a peer (memory or directory). Every copy read from a file or received
from a peer is checked against its checksum; a bad copy is excluded and the plan recomputed, so a
corrupt replica is never loaded (the step falls back to another copy, an older step, or None).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from restartable.checkpoint.errors import CheckpointError, ShardingMismatchError
from restartable.checkpoint.local import directory, integrity, packing, placement
from restartable.checkpoint.local.restore_target import IntoState, ReplicatedOwner, Target
from restartable.checkpoint.local.transport import Outgoing, transfer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestoreResult:
    """What LocalTier.load() restored on this rank: the step, where this rank's shard came from
    ("memory" | "local_dir" | "peer") and how long the whole restore took."""

    step: int
    tier: str
    seconds: float


@dataclass
class Shard:
    """One packed shard held in memory: `buf[:nbytes]` as saved by rank `owner` at `step`."""

    step: int
    owner: int
    world: int
    nbytes: int
    checksum: int | None  # None until computed (background: for a file or replica; else meta())
    buf: torch.Tensor
    parsed: packing.Parsed | None = None  # header, known without parsing for shards packed here

    def meta(self) -> directory.ShardMeta:
        check = self.checksum
        if check is None:
            check = integrity.of(self.buf, self.nbytes)
        return directory.ShardMeta(self.step, self.owner, self.world, self.nbytes, check)


def _gather(pg: dist.ProcessGroup | None, obj: Any, world: int) -> list[Any]:
    if pg is None:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj, group=pg)
    return out


def _any_rank(pg: dist.ProcessGroup | None, flag: bool) -> bool:
    """One small all_reduce (the common, all-good case needs no object gather)."""
    t = torch.tensor([int(flag)], dtype=torch.int32)
    if pg is not None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pg)
    return bool(t.item())


def restore(
    state: dict[str, Any],
    *,
    pg: dist.ProcessGroup | None,
    rank: int,
    world: int,
    held: dict[tuple[int, int], Shard],
    local_dir: Path | None,
    min_step: int | None,
    replicated_owner: ReplicatedOwner | None,
    max_step: int | None = None,
) -> RestoreResult | None:
    """COLLECTIVE: see LocalTier.load(). `held` = this rank's in-memory shards for this world
    (none after ``max_step``)."""
    t0 = time.perf_counter()
    on_disk = _scan(local_dir, held, world, max_step)
    mine = sorted(set(held) | set(on_disk))
    inventories = [[tuple(x) for x in inv] for inv in _gather(pg, mine, world)]
    bad: set[tuple[int, int, int]] = set()
    fetched: _Copy | None = None
    plan = None
    target: Target | None = None
    # Each failed round excludes at least one copy, so the loop ends within the copy count.
    for _ in range(1 + sum(len(inv) for inv in inventories)):
        plan = placement.plan_restore(world, inventories, min_step=min_step, bad=bad)
        if plan is None:
            break
        if target is None:
            target = Target(state, rank, world, replicated_owner, in_place=min_step is not None)
        into = target.into_state
        fetched, newly_bad = _fetch(plan, pg, rank, world, held, on_disk, into)
        if not _any_rank(pg, bool(newly_bad)):
            break
        _exclude(bad, _gather(pg, newly_bad, world), plan.step)
        plan, fetched = None, None
    if plan is None or fetched is None or target is None:
        _log_nothing(inventories, min_step, world)
        return None
    _refuse_mixed_sharding(target, fetched, pg, world)
    target.fill(fetched.buf, fetched.parsed, pg)
    seconds = time.perf_counter() - t0
    log.info(
        "restored local step %d on rank %d from %s in %.3f s",
        plan.step,
        rank,
        fetched.tier,
        seconds,
    )
    return RestoreResult(plan.step, fetched.tier, seconds)


def _scan(
    local_dir: Path | None, held: dict[tuple[int, int], Shard], world: int, max_step: int | None
) -> dict[tuple[int, int], directory.ShardMeta]:
    """The node-local directory's shards of this world size, by (step, owner). Scanned only when
    memory is empty (a fresh process or a reserve): a surviving process holds in memory
    everything it wrote, and a memory restore reads no file."""
    if local_dir is None or held:
        return {}
    found = directory.scan(local_dir, max_step)
    return {(m.step, m.owner): m for m in found if m.world == world}


def _exclude(bad: set[tuple[int, int, int]], all_bad: list[Any], step: int) -> None:
    """Add every rank's failed copies (step, owner, holder) to ``bad``, and say so."""
    for lst in all_bad:
        bad.update(tuple(x) for x in lst)
    log.warning(
        "local step %d: copies failed verification (step, owner, holder) %s; trying the "
        "next source",
        step,
        sorted(bad),
    )


def _log_nothing(inventories: list[list[Any]], min_step: int | None, world: int) -> None:
    level = logging.WARNING if any(inventories) else logging.INFO
    newer = "" if min_step is None else f" >= {min_step} (the persistent tier's newest)"
    log.log(
        level,
        "local tier: no step%s that every one of %d ranks can obtain at this world size",
        newer,
        world,
    )


def _refuse_mixed_sharding(
    target: Target, fetched: _Copy, pg: dist.ProcessGroup | None, world: int
) -> None:
    """COLLECTIVE: raise ShardingMismatchError on every rank when any rank's shard does not fit
    its live DTensors. Every rank refuses together, before any rank writes: a rank that filled
    its DTensors while another fell back to the persistent tier would train on a mixed state."""
    problem = target.sharding_mismatch(fetched.buf, fetched.parsed)
    if _any_rank(pg, problem is not None):
        problems = _gather(pg, problem, world)
        raise ShardingMismatchError(
            "; ".join(f"rank {r}: {p}" for r, p in enumerate(problems) if p is not None)
        )


class _Copy(NamedTuple):
    """A copy of one shard that this rank holds or has just received."""

    buf: torch.Tensor
    nbytes: int
    checksum: int
    tier: str  # "memory" | "local_dir" | "peer"
    parsed: packing.Parsed | None  # its header when known without parsing buf


def _fetch(
    plan: placement.RestorePlan,
    pg: dist.ProcessGroup | None,
    rank: int,
    world: int,
    held: dict[tuple[int, int], Shard],
    on_disk: dict[tuple[int, int], directory.ShardMeta],
    into_state: IntoState | None,
) -> tuple[_Copy | None, list[tuple[int, int, int]]]:
    """Run one plan: serve the shards assigned to this rank, obtain this rank's own."""
    step = plan.step
    if into_state is not None:
        into_state.clear()  # only this round's copy may have landed in place
    source = _Sources(step, held, on_disk)
    bad: list[tuple[int, int, int]] = []
    sends = []
    for r in range(world):
        if r != rank and plan.sources[r] == rank:
            copy = source.obtain(r)
            parsed = _header(copy) if copy is not None else None
            if copy is None or parsed is None:
                bad.append((step, r, rank))
                sends.append(Outgoing(r, step, r, world, 0, 0, None))
            else:
                sends.append(
                    Outgoing(r, step, r, world, copy.nbytes, copy.checksum, copy.buf, parsed)
                )
    mine: _Copy | None = None
    srcs: list[int] = []
    if plan.sources[rank] == rank:
        mine = source.obtain(rank, into_state, own=True)
        if mine is None:
            bad.append((step, rank, rank))
    else:
        srcs = [plan.sources[rank]]
    if pg is not None and (sends or srcs):
        got, failed = _exchange(pg, sends, srcs, (step, rank, world), into_state)
        mine = got if got is not None else mine
        bad += failed
    return mine, bad


class _Sources:
    """The copies of one step that this rank can read itself: memory (trusted), directory
    (verified by directory.read)."""

    def __init__(
        self,
        step: int,
        held: dict[tuple[int, int], Shard],
        on_disk: dict[tuple[int, int], directory.ShardMeta],
    ) -> None:
        self._step, self._held, self._on_disk = step, held, on_disk

    def obtain(
        self, owner: int, place: IntoState | None = None, *, own: bool = False
    ) -> _Copy | None:
        """(step, owner) from memory or the directory, or None. place: a directory copy's large
        tensors are read straight into the state. A memory copy's checksum is computed here
        when the save did not (no file, no replica) and the copy goes to a peer; this rank's
        `own` copy is trusted and needs none."""
        sh = self._held.get((self._step, owner))
        if sh is not None:
            check = sh.checksum
            if check is None:
                check = 0 if own else sh.meta().checksum
            return _Copy(sh.buf, sh.nbytes, check, "memory", sh.parsed)
        m = self._on_disk.get((self._step, owner))
        if m is not None:
            got = directory.read(m, place)
            if got is not None:
                return _Copy(got[0], m.nbytes, m.checksum, "local_dir", got[1])
        return None


def _exchange(
    pg: dist.ProcessGroup,
    sends: list[Outgoing],
    srcs: list[int],
    expect: tuple[int, int, int],
    into_state: IntoState | None,
) -> tuple[_Copy | None, list[tuple[int, int, int]]]:
    """Send what this rank serves, receive its own shard from `srcs`; (the verified copy that
    arrived or None, the (step, owner, holder) copies that failed). expect: (step, rank, world)."""
    step, rank, _ = expect
    mine: _Copy | None = None
    bad: list[tuple[int, int, int]] = []
    alloc = lambda n: torch.empty(n, dtype=torch.uint8)  # noqa: E731
    for inc in transfer(pg, sends, srcs, alloc, into_state):
        ok = (
            inc.buf is not None
            and (inc.step, inc.owner, inc.world) == expect
            and inc.received == inc.checksum
        )
        if ok and inc.buf is not None:
            parsed = into_state.parsed if into_state is not None else None
            mine = _Copy(inc.buf, inc.nbytes, inc.checksum, "peer", parsed)
        else:
            log.warning(
                "replica of rank %d step %d from rank %d failed verification", rank, step, inc.src
            )
            bad.append((step, rank, inc.src))
    return mine, bad


def _header(copy: _Copy) -> packing.Parsed | None:
    """The header of a copy about to be sent; None when it does not decode (a bad copy)."""
    if copy.parsed is not None:
        return copy.parsed
    try:
        return packing.parse(copy.buf[: copy.nbytes])
    except CheckpointError:
        return None
