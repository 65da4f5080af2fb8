"""The local checkpoint tier: host-memory copies, an optional node-local directory, peer replicas.

`CheckpointManager` owns one LocalTier and calls save / wait / load / close from the training
thread; the copy to the directory and the replication run on one background thread (replicas
travel on the manager's dedicated gloo group, never on the training group; the directory's copy
runs on the training thread when the process has no spare core: background.spare_core), and every
AGREE_EVERY saves the ranks agree which steps are complete through the job's store, so that a
restart can cancel that agreement at once instead of leaving a background collective in flight
(see checkpoint.local.background and checkpoint.exchange).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from restartable.checkpoint.collectives import rank_and_size
from restartable.checkpoint.config import LocalConfig
from restartable.checkpoint.errors import CheckpointError
from restartable.checkpoint.local import directory, packing, placement, walk
from restartable.checkpoint.local.background import BackgroundSaver, SaveJob, spare_core
from restartable.checkpoint.local.holdings import Holdings
from restartable.checkpoint.local.in_flight import InFlight
from restartable.checkpoint.local.memo import WalkMemo, split_parts
from restartable.checkpoint.local.overlap import CudaOps, DeviceOps, Snapshots
from restartable.checkpoint.local.peers import GroupSource, Peers
from restartable.checkpoint.local.plan import Plan, PlanCache
from restartable.checkpoint.local.reshard import restore_resharded
from restartable.checkpoint.local.restore import RestoreResult, Shard, restore
from restartable.checkpoint.worker import BackgroundWorker

__all__ = ["LocalTier", "RestoreResult"]

log = logging.getLogger(__name__)


class LocalTier:
    """Local tier owner: memory copies (+ directory + replicas) of the last `keep` steps.

    Call order (training thread, every rank): save(step, state) ... wait() ... load(...) ...
    close(). save() and load() are collective over the group's ranks. A failed background save is
    logged as a WARNING and leaves that step unrestorable from this tier (the persistent tier is
    the fallback); it never raises into training.

    What save() does on the training thread: walk the state (Stateful objects' state_dict()),
    compare the tensors' structure with the cached pack layout (rebuilt only when a key, dtype,
    shape or sharding changes), one torch._foreach_copy_ of every tensor into a reused buffer,
    and the JSON of the scalars. Everything else (checksum, file, replicas, the agreement of
    checkpoint.local.background) runs on one background thread, one step at a time.

    Memory: up to keep + 2 shard buffers of this rank (checkpoint.local.holdings), and as many
    for each replica it holds; buffers are reused from save to save.
    """

    def __init__(
        self,
        *,
        local_dir: str | os.PathLike[str] | None,
        replication_factor: int,
        algo: str,
        keep: int,
        group: GroupSource,
        timeout: float = 600.0,
        overlap: bool = False,
        device_ops: DeviceOps | None = None,
    ) -> None:
        # The manager passes a validated LocalConfig's values; direct callers get the same rules.
        LocalConfig(dir=local_dir, replication_factor=replication_factor, algo=algo, keep=keep)
        self._dir: Path | None = directory.validate(local_dir) if local_dir is not None else None
        self._factor = replication_factor
        self._algo = algo
        self._keep = keep
        self._group = group
        self._peers = Peers(group, timeout=timeout)
        self._hold = Holdings(keep)
        spare = spare_core()
        self._saver = BackgroundSaver(self._hold, self._dir, replication_factor, spare_core=spare)
        if self._dir is not None and not spare:
            _log_no_spare_core(self._dir)
        self._plans = PlanCache(algo)
        self._memo = WalkMemo()  # the save's walk: tensor mappings seen unchanged
        self._capacity_checked = 0
        self._worker = BackgroundWorker("local-ckpt")
        self._in_flight = InFlight(self._worker, timeout=timeout)
        self._closed = False
        # Overlapped GPU copies (checkpoint.local.overlap); device_ops: a test's fake streams.
        self._overlap = overlap
        self._ops = device_ops
        self._snapshots: Snapshots | None = None
        self._step_hook: RemovableHandle | None = None

    @property
    def _held(self) -> dict[tuple[int, int], Shard]:
        """The shards held in memory, by (step, owner) (tests read it)."""
        return self._hold.held

    # ---------------------------------------------------------------- save

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Copy `state` into reused host memory and return; the rest goes on behind.

        Waits first for the previous local save's background work (one in flight at a time).
        """
        if self._closed:
            raise CheckpointError("LocalTier.save() after close(): create a new manager")
        self._settle()
        t0 = time.perf_counter()
        pg = self._group.current()
        rank, world = rank_and_size(pg)
        if self._hold.stale(step, world):
            self._hold.forget_stale(step, world)
        statefuls: list[tuple[Any, dict[str, Any]]] = []
        parts = walk.save_parts(state, statefuls, self._memo)
        every, structure, objects = split_parts(parts)
        cache = self._plans.plan(parts, every, structure, rank, world)
        tensors = every if cache.kept is None else cache.kept(every)
        extra = {"step": step, "owner": rank, "world": world, "algo": self._algo}
        objects_json = packing.compact(objects)
        header = packing.header_bytes(cache.layout, objects, extra, objects_json=objects_json)
        size = packing.packed_size(cache.layout, header)
        nodes = self._peers.node_indices(pg)
        self._check_capacity(nodes, size)
        self._hold.make_room()
        buf = self._hold.take(size, pinned=cache.on_gpu)
        # The scalars' JSON, parsed back: a snapshot (a list mutated after save() must not leak).
        data_start = size - cache.layout.data_nbytes
        parsed = packing.Parsed(
            cache.entries, json.loads(objects_json), extra, data_start, cache.layout.sharding
        )
        agree = self._peers.next_agreement(pg)
        self._in_flight.agreement = agree[0] if agree is not None else None
        pg_ref = weakref.ref(pg) if pg is not None else None
        job = SaveJob(Shard(step, rank, world, size, None, buf, parsed), pg_ref, nodes, agree)
        copy = functools.partial(
            packing.pack_into, buf, cache.layout, header, tensors, non_blocking=cache.on_gpu
        )
        self._dispatch(job, copy, cache, tensors)
        log.debug(
            "local save of step %d staged %d bytes in %.3f s", step, size, time.perf_counter() - t0
        )

    def _dispatch(
        self, job: SaveJob, copy: Callable[[], int], cache: Plan, tensors: packing.Tensors
    ) -> None:
        """Run a staged save's copy (overlapped with training, or now) and hand its background
        work (checksum, file, replicas) to the worker thread, or run it here when inline."""
        snaps = self._overlapped(cache.on_gpu)
        if snaps is not None:
            names = [e.key for e in cache.layout.entries]
            snaps.start(tensors, names, copy, functools.partial(self._publish, job))
            return
        copy()
        if cache.on_gpu:
            torch.cuda.synchronize()  # the copy must be complete before save() returns
        self._hold.add_own(job.shard)
        if self._saver.inline(job):
            self._saver.run(job)
        else:
            self._in_flight.submit(self._saver.run, job)

    def _check_capacity(self, nodes: list[int], size: int) -> None:
        """Before the first save of a larger shard: the node-local directory has room for the
        copies it will hold (raises CheckpointError naming the directory)."""
        if self._dir is None or size <= self._capacity_checked:
            return
        factor = placement.effective_factor(nodes, self._factor)
        used = self._hold.used_bytes()
        directory.check_capacity(self._dir, (self._keep + 2) * factor * size, used)
        self._capacity_checked = size

    # ---------------------------------------------------------------- overlapped GPU copies

    def _overlapped(self, on_gpu: bool) -> Snapshots | None:
        """The tier's overlapped copies when this save's copy is one (the state is on a GPU,
        or a test gave its own DeviceOps) and no raced write turned them off, else None."""
        if not self._overlap or not (on_gpu or self._ops is not None):
            return None
        if self._snapshots is None:
            self._snapshots = Snapshots(self._ops or CudaOps())
            self._step_hook = self._snapshots.guard_optimizer_steps()
        return self._snapshots if self._snapshots.active else None

    def _publish(self, job: SaveJob, wait_for_copy: Callable[[], None]) -> None:
        """A guarded snapshot: on the tier's thread, once its copy ended, hold it and run its
        background work (never on the training thread, which must not block on the copy)."""
        self._in_flight.submit(self._run_published, job, wait_for_copy)

    def _run_published(self, job: SaveJob, wait_for_copy: Callable[[], None]) -> None:
        wait_for_copy()
        self._hold.add_own(job.shard)
        self._saver.run(job)

    def before_write(self) -> None:
        """Call before writing the saved state in place outside the optimizer's step (whose
        pre-hook does it): the write then waits for an overlapped copy still running. Cheap
        when nothing is pending; a no-op without overlapped copies."""
        if self._snapshots is not None:
            self._snapshots.guard()

    # ---------------------------------------------------------------- wait / load / close

    def _settle(self) -> None:
        """Before a collective entry point: end the previous background work, abandoning it
        first after an in-process restart (``InFlight.abandon_if_stale``)."""
        if self._snapshots is not None:
            self._snapshots.settle()
        self._in_flight.abandon_if_stale(self._group)
        self.wait()

    def wait(self) -> None:
        """Wait (bounded: 2 x timeout) for the background work of the last save (see
        ``InFlight.wait``)."""
        if self._snapshots is not None:
            self._snapshots.settle()
        self._in_flight.wait()

    def quarantine_after(self, step: int, name: str) -> list[tuple[str, int, str]]:
        """Rank-local: after settling, free the memory copies (own, replicas) of the steps after
        ``step`` and move their node-local files into ``<local_dir>/quarantine/<name>/``
        (``checkpoint.quarantine``). (tier, step, where) of each copy, for the log."""
        self._settle()
        gone = [("memory", s, f"rank {owner}'s copy") for s, owner in self._hold.forget_after(step)]
        return gone + [("local_dir", s, str(p)) for s, p in self._saver.quarantine(step, name)]

    def load(
        self, state: dict[str, Any], *, min_step: int | None, max_step: int | None = None
    ) -> RestoreResult | None:
        """COLLECTIVE: restore the newest step in [min_step, max_step] every rank can obtain,
        into `state` (a step after max_step is distrusted: ``quarantine_after``).

        Returns None (the manager falls back to the persistent tier) when no such step exists,
        e.g. the world size changed since the save or every copy of a shard was lost or corrupt.
        """
        if self._closed:
            raise CheckpointError("LocalTier.load() after close(): create a new manager")
        self._settle()
        pg = self._group.current()
        rank, world = rank_and_size(pg)
        every = [s for s in self._hold.shards() if max_step is None or s.step <= max_step]
        held = {(s.step, s.owner): s for s in every if s.world == world}
        fp = placement.replicated_owner if self._algo == "fully_parallel" else None
        found = restore(
            state,
            pg=pg,
            rank=rank,
            world=world,
            held=held,
            local_dir=self._dir,
            min_step=min_step,
            max_step=max_step,
            replicated_owner=fp,
        )
        if found is not None:
            return found
        # The world size changed (a rank lost with no reserve): the shards of the old world
        # are on this node, resharded before the manager falls back to the persistent tier.
        return restore_resharded(
            state,
            pg=pg,
            rank=rank,
            world=world,
            held=every,
            local_dir=self._dir,
            min_step=min_step,
            max_step=max_step,
        )

    def close(self) -> None:
        """Wait for background work, stop the worker thread and drop every buffer. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.wait()
        if self._worker.stop(timeout=5.0):  # its work is over or timed out above: never long
            self._saver.close()
        if self._step_hook is not None:
            self._step_hook.remove()
        self._hold.clear()
        self._memo = WalkMemo()
        self._plans.clear()  # its layout's cached views would keep the buffers alive

    def __enter__(self) -> LocalTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _log_no_spare_core(local_dir: Path) -> None:
    log.info(
        "local_dir %s: no spare CPU core (%d usable, LOCAL_WORLD_SIZE=%s): the "
        "node-local file is written on the training thread",
        local_dir,
        len(os.sched_getaffinity(0)),
        os.environ.get("LOCAL_WORLD_SIZE"),
    )
