"""Rank functions for the local checkpoint tier's multi-process tests (tests/dist/test_local_*)."""

from __future__ import annotations

import datetime
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def _rank() -> int:
    return int(os.environ["RANK"])


def _node_dir(base: str) -> str:
    # One directory per simulated node: what a node-local disk looks like on one machine.
    path = Path(base) / f"node{os.environ['GROUP_RANK']}"
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


def _init(iteration: int) -> None:
    """(Re)join the default group in a fresh store namespace, as an in-process restart does."""
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=30),
    )
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"iter{iteration}", store),
        rank=_rank(),
        world_size=int(os.environ["WORLD_SIZE"]),
    )


def _state(rank: int, world: int, step: int, big: int = 0) -> dict[str, Any]:
    """Deterministic state at `step`: a data-parallel replicated model part and per-rank parts
    (plus, with `big`, a per-rank tensor of that many float32s)."""
    from restartable.checkpoint.local import ReplicatedState

    g = torch.Generator().manual_seed(1000 * step)
    shared = {f"layer{i}.weight": torch.randn(64, 16 + i, generator=g) for i in range(6)}
    shared["layer0.bias"] = torch.randn(64, generator=g).to(torch.bfloat16)
    g.manual_seed(1000 * step + 1 + rank)
    opt = {"exp_avg": torch.randn(100, generator=g), "count": torch.tensor(step + rank)}
    if big:
        opt["big"] = torch.full((big,), float(step + 1000 * rank))
    return {
        "model": ReplicatedState(shared),
        "rng": torch.randint(0, 255, (32,), dtype=torch.uint8, generator=g),
        "opt": opt,
        "meta": {"step": step, "world": world, "name": f"rank{rank}"},
    }


def _zero(state: dict[str, Any]) -> None:
    for part in (state["model"], state["opt"]):
        for t in part.values():
            t.zero_()
    state["rng"].zero_()
    state["meta"]["step"] = -1


def _matches(state: dict[str, Any], rank: int, world: int, step: int) -> bool:
    want = _state(
        rank, world, step, big=state["opt"]["big"].numel() if "big" in state["opt"] else 0
    )
    ok = state["meta"] == want["meta"] and torch.equal(state["rng"], want["rng"])
    for part in ("model", "opt"):
        ok = ok and all(torch.equal(state[part][k], v) for k, v in want[part].items())
    return bool(ok)


def _save_steps(tier: Any, rank: int, world: int, steps: list[int], state: dict[str, Any]) -> None:
    for step in steps:
        fresh = _state(
            rank, world, step, big=state["opt"]["big"].numel() if "big" in state["opt"] else 0
        )
        for part in ("model", "opt"):
            for k, v in fresh[part].items():
                state[part][k].copy_(v)
        state["rng"].copy_(fresh["rng"])
        state["meta"] = fresh["meta"]
        tier.save(step, state)
    tier.wait()


def _tier(local_dir: str | None, algo: str, factor: int = 2, keep: int = 2) -> Any:
    from restartable.checkpoint.group import BackgroundGroup
    from restartable.checkpoint.local import LocalTier

    group = BackgroundGroup(timeout=30.0)
    tier = LocalTier(
        local_dir=local_dir, replication_factor=factor, algo=algo, keep=keep, group=group
    )
    return tier, group


def memory_after_restart(base: str) -> dict[str, Any]:
    """Save with atomic and fully_parallel, restart in-process, restore both from memory.

    The directories are emptied and checkpoint.local.directory.read is replaced by a function
    that fails, so a restore that touched a file would show up as a wrong tier or an exception.
    """
    from restartable.checkpoint.local import directory

    rank, world = _rank(), int(os.environ["WORLD_SIZE"])
    _init(0)
    out: dict[str, Any] = {}
    tiers = {}
    for algo in ("atomic", "fully_parallel"):
        tier, group = _tier(_node_dir(f"{base}/{algo}"), algo)
        state = _state(rank, world, 0)
        _save_steps(tier, rank, world, [1, 2, 3], state)
        tiers[algo] = (tier, group, state)
        out[f"{algo}_held_bytes"] = sum(s.nbytes for s in tier._held.values() if s.step == 3)
    dist.barrier()
    dist.destroy_process_group()  # the restart: old groups gone, memory kept
    for algo in ("atomic", "fully_parallel"):
        shutil.rmtree(f"{base}/{algo}", ignore_errors=True)

    def no_file_read(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a memory restore read a file")

    directory.read = no_file_read
    _init(1)
    restored = {}
    for algo, (tier, group, state) in tiers.items():
        _zero(state)
        res = tier.load(state, min_step=None)
        out[algo] = {"step": res.step, "tier": res.tier, "ok": _matches(state, rank, world, 3)}
        restored[algo] = state
        tier.close()
        group.close()
    a, f = restored["atomic"], restored["fully_parallel"]
    out["identical"] = all(torch.equal(a["model"][k], f["model"][k]) for k in a["model"]) and all(
        torch.equal(a["opt"][k], f["opt"][k]) for k in a["opt"]
    )
    dist.destroy_process_group()
    return out


def save_steps(base: str, algo: str, steps: list[int], big: int = 0) -> dict[str, Any]:
    """Phase 1 of the node-loss and corruption tests: save, then exit (memory gone)."""
    rank, world = _rank(), int(os.environ["WORLD_SIZE"])
    _init(0)
    tier, group = _tier(_node_dir(base), algo)
    _save_steps(tier, rank, world, steps, _state(rank, world, 0, big))
    tier.close()
    group.close()
    dist.destroy_process_group()
    return {"saved": steps}


def restore_fresh(
    base: str, algo: str, min_step: int | None = None, big: int = 0, small_parts: bool = True
) -> dict[str, Any]:
    """Phase 2: a fresh process per rank restores from its node directory or from peers.

    min_step set (a persistent checkpoint exists): a peer's copy is received into the state's
    tensors. small_parts: tiny parts and in-place tensors, so the test's small tensors take the
    paths that large ones take in production. Reports the growth of the peak RSS during load.
    """
    from restartable.checkpoint.local import parts
    from tests import peak_memory

    if small_parts:
        parts.PART_MAX = 4096  # many parts per shard: exercises the pipelined checksum
        parts.DIRECT_MIN = 256  # most tensors travel in parts of their own
    rank, world = _rank(), int(os.environ["WORLD_SIZE"])
    _init(0)
    tier, group = _tier(_node_dir(base), algo)
    state = _state(rank, world, 0, big)
    _zero(state)
    res, grown = peak_memory.growth_mib(lambda: tier.load(state, min_step=min_step))
    out = {
        "step": res.step,
        "tier": res.tier,
        "ok": _matches(state, rank, world, res.step),
        "peak_rss_growth_mib": grown,
    }
    tier.close()
    group.close()
    dist.destroy_process_group()
    return out


def _flip_last_byte(node_dir: Path, step: int, owner: int) -> None:
    """Corrupt the copy of (step, owner) in a node directory inside its last tensor: only the
    checksum can notice."""
    from restartable.checkpoint.local import directory

    (meta,) = [m for m in directory.scan(node_dir) if (m.step, m.owner) == (step, owner)]
    with open(meta.path, "r+b") as f:
        f.seek(directory.DATA_OFFSET + meta.nbytes - 1)
        last = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([last ^ 0xFF]))


def restore_corrupt(base: str) -> dict[str, Any]:
    """Phase 2 of the corruption test: corrupt copies one by one, restore after each.

    Rank 0's shard of step 2 lives in node0 (own) and node1 (replica); step 1 likewise.
    """
    rank, world = _rank(), int(os.environ["WORLD_SIZE"])
    _init(0)
    tier, group = _tier(_node_dir(base), "atomic")
    results = []
    corrupt_before = [  # (node directory, step) of rank 0's shard
        [("node0", 2)],  # own copy bad -> the peer's replica
        [("node1", 2)],  # both copies of step 2 bad -> step 1
        [("node0", 1), ("node1", 1)],  # -> None
    ]
    for copies in corrupt_before:
        if rank == 0:
            for node, step in copies:
                _flip_last_byte(Path(base) / node, step, owner=0)
        dist.barrier()
        state = _state(rank, world, 0)
        _zero(state)
        res = tier.load(state, min_step=None)
        if res is None:
            results.append(None)
        else:
            ok = _matches(state, rank, world, res.step)
            results.append({"step": res.step, "tier": res.tier, "ok": ok})
        dist.barrier()
    tier.close()
    group.close()
    dist.destroy_process_group()
    return {"results": results}


def corrupt_replica_in_place(base: str) -> dict[str, Any]:
    """A replica corrupted in its holder's memory (memory copies are sent unverified) arrives in
    place, into the receiver's state tensors; the receiver's checksum rejects it and the next
    source (step 1) must overwrite every tensor the bad copy wrote."""
    from restartable.checkpoint.local import parts

    parts.DIRECT_MIN = 256  # the test's small tensors land in place, as large ones do
    rank, world = _rank(), int(os.environ["WORLD_SIZE"])
    _init(0)
    tier, group = _tier(None, "atomic")
    state = _state(rank, world, 0)
    _save_steps(tier, rank, world, [1, 2], state)
    if rank == 0:  # holds rank 2's replicas (node 0 backs up node 1)
        shard = tier._held[(2, 2)]
        shard.buf[shard.nbytes - 1] ^= 0xFF  # inside the last tensor
    dist.barrier()
    if rank in (2, 3):  # node 1 lost its memory: fresh tiers (on the same dedicated group)
        from restartable.checkpoint.local import LocalTier

        tier.close()
        tier = LocalTier(local_dir=None, replication_factor=2, algo="atomic", keep=2, group=group)
    _zero(state)
    res = tier.load(state, min_step=1)
    out = {"step": res.step, "tier": res.tier, "ok": _matches(state, rank, world, res.step)}
    tier.close()
    group.close()
    dist.destroy_process_group()
    return out


def with_manager(base: str, algo: str) -> dict[str, Any]:
    """The local tier through CheckpointManager: memory after a restart, then directory / peer
    for a new manager (a new process's view), with node 1's directory lost."""
    from restartable.checkpoint.manager import CheckpointManager

    rank, world = _rank(), int(os.environ["WORLD_SIZE"])

    def manager() -> CheckpointManager:
        return CheckpointManager(
            f"{base}/persistent",
            persistent_every=2,
            keep=2,
            local_every=1,
            local_dir=_node_dir(f"{base}/local"),
            replication_factor=2,
            local_algo=algo,
            timeout=30.0,
        )

    _init(0)
    out: dict[str, Any] = {}
    mgr = manager()
    state = _state(rank, world, 0)
    for step in (1, 2, 3):
        _save_steps(mgr, rank, world, [step], state)
    dist.destroy_process_group()  # in-process restart
    _init(1)
    _zero(state)
    got = mgr.load_latest(state)
    out["restart"] = [got, mgr.last_restore.tier, _matches(state, rank, world, 3)]
    mgr.close()
    if rank == 2:
        shutil.rmtree(f"{base}/local/node1")
    dist.barrier()
    mgr = manager()
    _zero(state)
    got = mgr.load_latest(state)
    out["new_manager"] = [got, mgr.last_restore.tier, _matches(state, rank, world, 3)]
    mgr.close()
    dist.destroy_process_group()
    return out


def restartable_reserve(base: str, config: dict[str, Any]) -> dict[str, Any]:
    """Under @restartable: rank 1 is SIGKILLed after step 3; a reserve from another node plays
    rank 1 and gets rank 1's shard from a peer replica, the survivors from their memory."""
    from restartable.checkpoint.manager import CheckpointManager
    from restartable.inprocess import restartable
    from restartable.inprocess.context import context

    me = _rank()
    mgr = CheckpointManager(
        f"{base}/persistent",
        persistent_every=100,
        keep=2,
        local_every=1,
        local_dir=_node_dir(f"{base}/local"),
        replication_factor=2,
        timeout=30.0,
    )

    # CPU tensors: gloo, also on a host with a GPU (the default is nccl there).
    @restartable(**{"backend": "gloo", **config})
    def train() -> dict[str, Any]:
        ctx = context()
        world = ctx.world_size
        state = _state(ctx.rank, world, 0)
        _zero(state)
        step = mgr.load_latest(state)
        restored = mgr.last_restore
        out = {
            "iteration": ctx.iteration,
            "rank": ctx.rank,
            "step": step,
            "tier": restored.tier if restored else None,
            "ok": step is None or _matches(state, ctx.rank, world, step),
        }
        if ctx.iteration == 0:
            for s in (1, 2, 3):
                _save_steps(mgr, ctx.rank, world, [s], state)
            mgr.wait()
            dist.barrier()
            if me == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            dist.barrier()  # released by the restart
        return out

    try:
        return {"result": train()}
    finally:
        mgr.close()


def restart_interrupts_wait(base: str) -> dict[str, Any]:
    """Rank 0 saves a step that rank 1 never saves (rank 1 failed first) and is inside
    ``mgr.wait()`` when the restart interrupts it. After the restart the blocked background work
    must be abandoned at once, not waited for (2 x timeout), and saving must go on."""
    import time

    from restartable.checkpoint.manager import CheckpointManager
    from tests.dist.workers_persistent import wait_interrupted

    rank, world = _rank(), int(os.environ["WORLD_SIZE"])
    _init(0)
    mgr = CheckpointManager(
        f"{base}/persistent", persistent_every=1000, local_every=1, timeout=60.0
    )
    state = _state(rank, world, 0)
    _save_steps(mgr, rank, world, [1], state)
    if rank == 0:
        mgr.save(2, state)
        wait_interrupted(mgr)
    dist.barrier()
    dist.destroy_process_group()  # the restart
    _init(1)
    _zero(state)
    t0 = time.perf_counter()
    got = mgr.load_latest(state)
    load_s = time.perf_counter() - t0
    restored = _matches(state, rank, world, 1)
    _save_steps(mgr, rank, world, [3], state)
    mgr.wait()
    mgr.close()
    dist.destroy_process_group()
    return {"got": got, "restored": restored, "load_s": load_s}
