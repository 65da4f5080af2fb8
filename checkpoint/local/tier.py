"""The local checkpoint tier: host-memory copies, an optional node-local directory, peer replicas.

`CheckpointManager` owns one LocalTier and calls save / wait / load / close from the training
thread; the copy to the directory and the replication run on one background thread (replicas
travel on the manager's dedicated gloo group, never on the training group), and the ranks agree
that a step is complete through the job's store, so that a restart can cancel that agreement at
once instead of leaving a background collective in flight (see checkpoint.exchange).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import weakref
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from checkpoint.collectives import rank_and_size
from checkpoint.config import LocalConfig
from checkpoint.errors import CheckpointAbandoned, CheckpointError
from checkpoint.exchange import Attempts, StoreExchange
from checkpoint.local import directory, integrity, packing, placement
from checkpoint.local.reshard import restore_resharded
from checkpoint.local.restore import RestoreResult, Shard, restore
from checkpoint.local.transport import Outgoing, transfer
from checkpoint.worker import BackgroundWorker

__all__ = ["LocalTier", "RestoreResult"]

log = logging.getLogger(__name__)


class GroupSource(Protocol):
    """What the tier needs from checkpoint.group.BackgroundGroup."""

    def current(self) -> dist.ProcessGroup | None: ...

    def is_stale(self) -> bool: ...

    def drop(self) -> None: ...

    @property
    def generation(self) -> int: ...

    @property
    def token(self) -> str | None: ...


@dataclass
class _Cache:
    """Per-structure plan, rebuilt only when the state's keys, dtypes or shapes change."""

    signature: tuple[Any, ...]
    world: int
    rank: int
    keep_keys: frozenset[str]  # tensor keys this rank stores (fully_parallel drops the others)
    layout: packing.ShardLayout
    entries: dict[str, packing.TensorEntry]  # layout by key: a memory restore skips the header


class LocalTier:
    """Local tier owner: memory copies (+ directory + replicas) of the last `keep` steps.

    Call order (training thread, every rank): save(step, state) ... wait() ... load(...) ...
    close(). save() and load() are collective over the group's ranks. A failed background save is
    logged as a WARNING and leaves that step unrestorable from this tier (the persistent tier is
    the fallback); it never raises into training.

    Memory: up to keep + 2 shard buffers of this rank (kept steps, one incomplete, one in flight),
    and as many for each replica it holds; buffers are reused from save to save.
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
    ) -> None:
        # The manager passes a validated LocalConfig's values; direct callers get the same rules.
        LocalConfig(dir=local_dir, replication_factor=replication_factor, algo=algo, keep=keep)
        self._dir: Path | None = directory.validate(local_dir) if local_dir is not None else None
        self._factor = replication_factor
        self._algo = algo
        self._keep = keep
        self._group = group
        self._node = node_key()
        # Per dedicated group, keyed by its generation: holding the group object itself would keep
        # a destroyed group's sockets open after a restart.
        self._nodes: tuple[tuple[bool, int], list[int]] | None = None
        self._lock = threading.Lock()  # guards _held / _complete / _free (training vs worker)
        self._held: dict[tuple[int, int], Shard] = {}
        self._complete: list[int] = []
        self._free: list[torch.Tensor] = []
        self._cache: _Cache | None = None
        self._placement: tuple[list[int], list[list[int]], list[list[int]]] | None = None
        self._capacity_checked = 0
        self._warned_factor = False
        self._worker = BackgroundWorker("local-ckpt")
        self._future: Future[None] | None = None
        self._agreement: StoreExchange | None = None  # of the background work in flight
        self._timeout = timeout
        self._attempts = Attempts("local", timeout=timeout)
        self._closed = False

    # ---------------------------------------------------------------- save

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Copy `state` into reused host memory and return; dir write + replication go on behind.

        Waits first for the previous local save's background work (one in flight at a time).
        """
        if self._closed:
            raise CheckpointError("LocalTier.save() after close(): create a new manager")
        self._settle()
        t0 = time.perf_counter()
        pg = self._group.current()
        rank, world = rank_and_size(pg)
        self._forget_stale(step, world)
        statefuls: list[tuple[Any, dict[str, Any]]] = []
        leaves = packing.leaves(state, statefuls)
        cache = self._plan(leaves, rank, world)
        tensors = [x for x in leaves if isinstance(x.value, torch.Tensor)]
        tensors = [x for x in tensors if x.key in cache.keep_keys]
        objects = {x.key: x.value for x in leaves if not isinstance(x.value, torch.Tensor)}
        extra = {"step": step, "owner": rank, "world": world, "algo": self._algo}
        header = packing.header_bytes(cache.layout, objects, extra)
        size = packing.packed_size(cache.layout, header)
        nodes = self._node_indices(pg)
        if self._dir is not None and size > self._capacity_checked:
            factor = placement.effective_factor(nodes, self._factor)
            used = sum(s.nbytes for s in self._held.values())
            directory.check_capacity(self._dir, (self._keep + 2) * factor * size, used)
            self._capacity_checked = size
        on_gpu = any(x.value.is_cuda for x in tensors)
        buf = self._take(size, pinned=on_gpu)
        nbytes = packing.pack_into(buf, cache.layout, header, tensors)
        if on_gpu:
            torch.cuda.synchronize()  # the copy must be complete before save() returns
        # A JSON round trip snapshots the scalars (a list mutated after save() must not leak in).
        snapshot = json.loads(json.dumps(objects))
        data_start = nbytes - cache.layout.data_nbytes
        parsed = packing.Parsed(cache.entries, snapshot, extra, data_start, cache.layout.sharding)
        shard = Shard(step, rank, world, nbytes, None, buf, parsed)
        with self._lock:
            self._held[(step, rank)] = shard
        stall = time.perf_counter() - t0
        log.debug("local save of step %d staged %d bytes in %.3f s", step, nbytes, stall)
        agree = self._attempts.next(pg, self._group.token)
        self._agreement = agree[0]
        # The background work holds the group weakly (see _replicate): a strong reference in
        # the work item would keep a restart's destroyed group, and its sockets, alive.
        pg_ref = weakref.ref(pg) if pg is not None else None
        self._future = self._worker.submit(self._background, shard, pg_ref, nodes, agree)

    def _forget_stale(self, step: int, world: int) -> None:
        """Free memory copies that can no longer be restored or belong to an abandoned run.

        A different world size cannot be served (the persistent tier reshards instead); steps
        >= `step` are from before a rewind (training restarted from an older checkpoint), and
        restoring them later would jump back onto the abandoned trajectory.
        """
        with self._lock:
            stale = [k for k, sh in self._held.items() if sh.world != world or sh.step >= step]
            for key in stale:
                self._free.append(self._held.pop(key).buf)
            self._complete = [c for c in self._complete if c < step]

    def _plan(self, leaves: list[packing.Leaf], rank: int, world: int) -> _Cache:
        # dtype and torch.Size compare and hash as they are: no str() / tuple() per tensor.
        sig = tuple(
            (x.key, x.value.dtype, x.value.shape, x.replicated, x.sharding)
            for x in leaves
            if isinstance(x.value, torch.Tensor)
        )
        c = self._cache
        if c is not None and c.signature == sig and c.world == world and c.rank == rank:
            return c
        tensors = [x for x in leaves if isinstance(x.value, torch.Tensor)]
        owner = replicated_owner(tensors, world) if self._algo == "fully_parallel" else {}
        keep = frozenset(x.key for x in tensors if owner.get(x.key, rank) == rank)
        layout = packing.ShardLayout.of([x for x in tensors if x.key in keep])
        entries = {e.key: e for e in layout.entries}
        self._cache = _Cache(sig, world, rank, keep, layout, entries)
        return self._cache

    def _take(self, nbytes: int, pinned: bool = False) -> torch.Tensor:
        """A reused buffer of at least nbytes, else a new pre-faulted one (first saves only).

        pinned: page-locked, so device-to-host copies of GPU state run at full speed.
        """
        with self._lock:
            fits = [b for b in self._free if b.numel() >= nbytes and b.is_pinned() >= pinned]
            if fits:
                best = min(fits, key=lambda b: b.numel())
                self._free = [b for b in self._free if b is not best]
                return best
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        buf.zero_()  # fault the pages in now, not during the copy of a later save
        return buf

    def _node_indices(self, pg: dist.ProcessGroup | None) -> list[int]:
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

    def _background(
        self,
        shard: Shard,
        pg_ref: weakref.ref[dist.ProcessGroup] | None,
        nodes: list[int],
        agree: tuple[StoreExchange, StoreExchange | None],
    ) -> None:
        """Checksum, directory write, replication, then agreement that the step is complete."""
        t0 = time.perf_counter()
        ok = True
        shard.checksum = integrity.of(shard.buf, shard.nbytes)
        if self._dir is not None:
            try:
                directory.write(self._dir, shard.meta(), shard.buf)
            except Exception as e:  # never skip the collectives below: peers would wait on us
                ok = False
                log.warning(
                    "local save of step %d on rank %d: writing %s failed: %s",
                    shard.step, shard.owner, self._dir, e,
                )  # fmt: skip
        if pg_ref is not None and shard.world > 1:
            ex, previous = agree
            try:
                ok = self._replicate(shard, pg_ref, nodes) and ok
                flags = ex.gather("ok", ok)
                if flags is not None:  # rank 0
                    if previous is not None:  # every rank is past the previous verdict
                        previous.discard("verdict")
                    ex.publish("verdict", all(flags))
                ok = bool(ex.receive("verdict"))
            except CheckpointAbandoned:
                log.info("local save of step %d abandoned (restart)", shard.step)
                return
            except Exception as e:  # a dead peer, a restart, a torn-down group: incomplete
                log.warning(
                    "local save of step %d on rank %d: replication failed: %s",
                    shard.step, shard.owner, e,
                )  # fmt: skip
                ok = False
        if ok:
            with self._lock:
                self._complete = sorted({*self._complete, shard.step})
            self._prune()
            # DEBUG: the local tier typically saves every step; INFO would flood the log.
            log.debug(
                "local save of step %d complete on every rank (%d bytes) in %.3f s",
                shard.step,
                shard.nbytes,
                time.perf_counter() - t0,
            )
        else:
            log.warning("local step %d is incomplete: it will not be restored", shard.step)

    def _replicate(
        self, shard: Shard, pg_ref: weakref.ref[dist.ProcessGroup], nodes: list[int]
    ) -> bool:
        """Send this rank's shard to its peers and take theirs (background thread).

        The group is held strongly only for the transfer itself. A group destroyed by a restart
        before that (the reference is dead) abandons the step; one destroyed during it fails the
        transfer as soon as the peers closed theirs.
        """
        eff = placement.effective_factor(nodes, self._factor)
        if eff < self._factor and not self._warned_factor:
            self._warned_factor = True
            # Once per job (rank 0), not once per rank: the same fact on every rank.
            log.log(
                logging.WARNING if shard.owner == 0 else logging.DEBUG,
                "replication_factor %d needs %d nodes, the job has %d (node = host and launch "
                "node index): keeping %d cop%s per shard",
                self._factor,
                self._factor,
                placement.num_nodes(nodes),
                eff,
                "y" if eff == 1 else "ies",
            )
        if eff == 1:
            return True
        pg = pg_ref()
        if pg is None:
            raise CheckpointAbandoned(f"local save of step {shard.step}: the group was destroyed")
        if self._placement is None or self._placement[0] is not nodes:
            plan = placement.placement(nodes, self._factor)
            self._placement = (nodes, plan, placement.received_from(plan))
        _, plan, inverse = self._placement
        m = shard.meta()
        sends = [
            Outgoing(dst, m.step, m.owner, m.world, m.nbytes, m.checksum, shard.buf, shard.parsed)
            for dst in plan[shard.owner]
        ]
        srcs = inverse[shard.owner]
        ok = True
        for inc in transfer(pg, sends, srcs, self._take):
            if inc.buf is None or inc.received != inc.checksum:
                log.warning("replica of rank %d step %d failed its checksum", inc.src, inc.step)
                ok = False
                continue
            rep = Shard(inc.step, inc.owner, inc.world, inc.nbytes, inc.checksum, inc.buf)
            with self._lock:
                self._held[(rep.step, rep.owner)] = rep
            if self._dir is not None:
                try:
                    directory.write(self._dir, rep.meta(), rep.buf)
                except OSError as e:
                    log.warning(
                        "writing replica of rank %d to %s failed: %s", inc.src, self._dir, e
                    )
                    ok = False
        return ok

    def _prune(self) -> None:
        """Free steps older than the newest `keep` complete ones (they are complete everywhere)."""
        with self._lock:
            self._complete = self._complete[-self._keep :]
            oldest = self._complete[0]
            for key in [k for k in self._held if k[0] < oldest]:
                self._free.append(self._held.pop(key).buf)
        if self._dir is not None:
            # Only older steps: a co-located rank may already be writing a newer one.
            directory.remove_steps_older_than(self._dir, oldest)

    # ---------------------------------------------------------------- wait / load / close

    def _settle(self) -> None:
        """Before a collective entry point: end the previous background work.

        After an in-process restart the default group changed; the dedicated group of the work
        in flight is dropped first, which closes its sockets and releases a transfer blocked on a
        peer that is gone (instead of waiting for the group's timeout). That step stays
        incomplete; the steps before it are untouched.
        """
        if self._future is not None and self._group.is_stale():
            if not self._future.done():
                log.warning("process group changed with a local save in flight: abandoning it")
            if self._agreement is not None:
                self._agreement.abandon()
            self._group.drop()
        self.wait()

    def wait(self) -> None:
        """Wait (bounded: 2 x timeout) for the background work of the last save.

        The work stays "in flight" until it ended: a restart that interrupts this wait must
        still find it in ``_settle`` and abandon it, or it would stay blocked on a lost peer.
        """
        fut = self._future
        if fut is None:
            return
        try:
            fut.result(timeout=2 * self._timeout)
        except FutureTimeout:
            log.error(
                "local save background work did not finish within %.0f s: its step will "
                "not be restored from this tier",
                2 * self._timeout,
            )
            if self._agreement is not None:
                self._agreement.abandon()
        except Exception:
            log.warning("local save background work failed", exc_info=True)
        self._future = None

    def load(self, state: dict[str, Any], *, min_step: int | None) -> RestoreResult | None:
        """COLLECTIVE: restore the newest step >= min_step every rank can obtain, into `state`.

        Returns None (the manager falls back to the persistent tier) when no such step exists,
        e.g. the world size changed since the save or every copy of a shard was lost or corrupt.
        """
        if self._closed:
            raise CheckpointError("LocalTier.load() after close(): create a new manager")
        self._settle()
        pg = self._group.current()
        rank, world = rank_and_size(pg)
        with self._lock:
            every = list(self._held.values())
        held = {(s.step, s.owner): s for s in every if s.world == world}
        fp = replicated_owner if self._algo == "fully_parallel" else None
        found = restore(
            state,
            pg=pg,
            rank=rank,
            world=world,
            held=held,
            local_dir=self._dir,
            min_step=min_step,
            replicated_owner=fp,
        )
        if found is not None:
            return found
        # The world size changed (a rank lost with no reserve): the shards of the old world
        # are on this node, resharded before the manager falls back to the persistent tier.
        return restore_resharded(
            state, pg=pg, rank=rank, world=world, held=every, local_dir=self._dir,
            min_step=min_step,
        )  # fmt: skip

    def close(self) -> None:
        """Wait for background work, stop the worker thread and drop every buffer. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.wait()
        self._worker.stop(timeout=5.0)  # its work is over or timed out above: never wait long
        with self._lock:
            self._held.clear()
            self._free.clear()
        self._cache = None  # its layout's cached views would keep the buffers alive

    def __enter__(self) -> LocalTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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


def replicated_owner(tensors: list[packing.Leaf], world: int) -> dict[str, int]:
    """fully_parallel: the rank that keeps each tensor under a ReplicatedState."""
    rep = [(x.key, x.value.numel() * x.value.element_size()) for x in tensors if x.replicated]
    return placement.assign_replicated(rep, world)
