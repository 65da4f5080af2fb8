"""Restore the local tier onto a different world size (a job that shrank or grew).

Called by ``LocalTier.load()`` on every rank of the current world, on the tier's gloo group, after
the same-world restore found nothing. The shards of a step saved by ``W`` ranks (``W`` != the
current world) are read from this process's memory or its node-local directory (on one node, the
directory holds every rank's shard, the killed rank's too) and the state is filled key by key:
a key from the shard of the old rank with this rank's number when it has it (a per-rank value,
e.g. ``rerun_rank1``), else from the first old shard that holds it (a replicated tensor; with
``fully_parallel`` only its owner kept it). That is the rule DCP's planner applies to plain
tensors saved by every rank (one copy per key, read by every rank), so the state loads as
``torch.distributed.checkpoint`` would load it from the persistent tier, without the trip to
storage.

Plain tensors and objects only: a state with a DTensor (a sharded model, whose shards would need
a new placement) is not resharded here; the manager then loads the persistent tier, which
reshards it. A step is used only when every rank finds all ``W`` shards on its own node and
every copy passes its checksum; otherwise every rank returns None (the persistent tier).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from restartable.checkpoint.errors import CheckpointError
from restartable.checkpoint.local import directory, packing, unpacking, walk
from restartable.checkpoint.local.leaf import Leaf
from restartable.checkpoint.local.restore import RestoreResult, Shard

log = logging.getLogger(__name__)


def restore_resharded(
    state: dict[str, Any],
    *,
    pg: dist.ProcessGroup | None,
    rank: int,
    world: int,
    held: Iterable[Shard],
    local_dir: Path | None,
    min_step: int | None,
    max_step: int | None = None,
) -> RestoreResult | None:
    """COLLECTIVE: fill ``state`` from the newest step in [``min_step``, ``max_step``] that
    another world size saved and every rank can read whole on its node; its result, or None.

    ``held``: every shard in this process's memory (any world size). Blocks on two small
    all-gathers and one all-reduce on ``pg``; reads files of ``local_dir``.
    """
    t0 = time.perf_counter()
    memory, on_disk = _other_worlds(held, local_dir, world, max_step)
    mine = [list(k) for k in sorted(set(memory) | set(on_disk))]
    inventories = [{tuple(x) for x in inv} for inv in _gather_json(pg, mine, world)]
    step_world = _newest_whole(inventories, min_step)
    if step_world is None:
        return None
    step, old_world = step_world
    # Walked only now (state_dict() may change a Stateful: see restore_target.Target).
    statefuls: list[tuple[Any, dict[str, Any]]] = []
    leaves = walk.leaves(state, statefuls)
    if _has_dtensor(leaves):  # the same on every rank: the same structure everywhere
        log.info("local tier: a DTensor state is not resharded here; the persistent tier is")
        return None
    copies, tiers = _read_copies(step, old_world, memory, on_disk)
    plan = _plan(leaves, copies, rank) if len(copies) == old_world else None
    if _any_rank(pg, plan is None):
        _log_unreadable(step, old_world)
        return None
    assert plan is not None  # every rank has one: _any_rank said so
    _fill(plan, copies, statefuls)
    seconds = time.perf_counter() - t0
    tier = "local_dir" if "local_dir" in tiers else "memory"
    log.info(
        "restored local step %d on rank %d by resharding %d ranks' shards onto %d (%s) in %.3f s",
        step,
        rank,
        old_world,
        world,
        tier,
        seconds,
    )
    return RestoreResult(step, tier, seconds)


def _other_worlds(
    held: Iterable[Shard], local_dir: Path | None, world: int, max_step: int | None = None
) -> tuple[dict[tuple[int, int, int], Shard], dict[tuple[int, int, int], directory.ShardMeta]]:
    """The shards of other world sizes this rank can read itself, by (step, world, owner): in
    memory, and in the node-local directory (None: no directory)."""
    memory = {(s.step, s.world, s.owner): s for s in held if s.world != world}
    on_disk: dict[tuple[int, int, int], directory.ShardMeta] = {}
    if local_dir is not None:
        found = directory.scan(local_dir, max_step)
        on_disk = {(m.step, m.world, m.owner): m for m in found}
        on_disk = {k: m for k, m in on_disk.items() if m.world != world}
    return memory, on_disk


def _log_unreadable(step: int, old_world: int) -> None:
    log.warning(
        "local tier: step %d of %d ranks could not be read whole on every rank (a copy "
        "missing, corrupt or of another structure); use the persistent tier",
        step,
        old_world,
    )


def _fill(
    plan: dict[int, list[Leaf]],
    copies: dict[int, tuple[torch.Tensor, packing.Parsed]],
    statefuls: list[tuple[Any, dict[str, Any]]],
) -> None:
    """Fill each old shard's share of the leaves from its copy; Stateful objects load last."""
    for owner, leaves in plan.items():
        buf, parsed = copies[owner]
        unpacking.fill_leaves(buf, leaves, parsed=parsed)
    for obj, sd in statefuls:
        obj.load_state_dict(sd)


def _read_copies(
    step: int,
    old_world: int,
    memory: dict[tuple[int, int, int], Shard],
    on_disk: dict[tuple[int, int, int], directory.ShardMeta],
) -> tuple[dict[int, tuple[torch.Tensor, packing.Parsed]], set[str]]:
    """This rank's copy of every old shard of ``step`` (memory first, then the directory,
    verified), stopping at the first one missing or bad; and the tiers they came from."""
    copies: dict[int, tuple[torch.Tensor, packing.Parsed]] = {}
    tiers = set()
    for owner in range(old_world):
        key = (step, old_world, owner)
        if key in memory:
            sh = memory[key]
            buf = sh.buf[: sh.nbytes]
            try:
                parsed = sh.parsed if sh.parsed is not None else packing.parse(buf)
            except CheckpointError:
                break
            copies[owner] = (buf, parsed)
            tiers.add("memory")
        elif key in on_disk:
            got = directory.read(on_disk[key])
            if got is None:
                break
            copies[owner] = got
            tiers.add("local_dir")
    return copies, tiers


def _newest_whole(
    inventories: list[set[tuple[Any, ...]]], min_step: int | None
) -> tuple[int, int] | None:
    """The newest (step, old world) whose every shard is in every rank's inventory."""
    candidates = {(int(s), int(w)) for inv in inventories for s, w, _ in inv}
    whole = [
        (s, w)
        for s, w in candidates
        if (min_step is None or s >= min_step)
        and all(all((s, w, o) in inv for o in range(w)) for inv in inventories)
    ]
    return max(whole) if whole else None


def _plan(
    leaves: list[Leaf], copies: dict[int, tuple[torch.Tensor, packing.Parsed]], rank: int
) -> dict[int, list[Leaf]] | None:
    """Which old shard fills each leaf (see the module docstring); None when a key is in no
    shard or differs in dtype or shape (checked before anything is written)."""
    order = ([rank] if rank in copies else []) + [o for o in sorted(copies) if o != rank]
    plan: dict[int, list[Leaf]] = {}
    for leaf in leaves:
        tensor = isinstance(leaf.value, torch.Tensor)
        owner = next(
            (
                o
                for o in order
                if leaf.key in (copies[o][1].entries if tensor else copies[o][1].objects)
            ),
            None,
        )
        if owner is None:
            return None
        plan.setdefault(owner, []).append(leaf)
    try:
        for owner, part in plan.items():
            unpacking.match(copies[owner][1], part)
    except CheckpointError:
        return None
    return plan


def _has_dtensor(leaves: list[Leaf]) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without DTensor: nothing to find
        return False
    return any(isinstance(x.value, DTensor) for x in leaves)


def _gather_json(pg: dist.ProcessGroup | None, obj: Any, world: int) -> list[Any]:
    """Every rank's ``obj`` as plain JSON (nothing unpickled: the design's trust model)."""
    if pg is None:
        return [obj]
    data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, size, group=pg)
    top = int(max(int(s.item()) for s in sizes))
    padded = torch.zeros(top, dtype=torch.uint8)
    padded[: data.numel()] = data
    parts = [torch.zeros(top, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(parts, padded, group=pg)
    return [
        json.loads(bytes(p[: int(s.item())].numpy()).decode())
        for p, s in zip(parts, sizes, strict=True)
    ]


def _any_rank(pg: dist.ProcessGroup | None, flag: bool) -> bool:
    t = torch.tensor([int(flag)], dtype=torch.int32)
    if pg is not None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pg)
    return bool(t.item())
