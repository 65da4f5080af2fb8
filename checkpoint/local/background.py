"""The local tier's background work for one saved step: checksum, file, replicas, agreement.

Runs on the tier's one worker thread (checkpoint.worker), one step at a time, in save order. A
step with nothing that may block (no replica, no agreement) runs on the training thread instead,
within LocalTier.save, when it has no node-local file or the process has no spare core
(BackgroundSaver.inline).
Per step: the shard's xxh3_64 checksum (once: the file's record and the replicas' headers reuse
it), the node-local file, the replica transfers on the dedicated gloo group. Every
`AGREE_EVERY`-th save of a group (and its first) then runs the cross-rank agreement through the
store: each rank offers the recent steps it completed (at most two: this one and the one
before), rank 0 publishes the newest one that every rank offered, and every rank confirms it
(checkpoint.local.holdings). The steps in between need no store round trip at all.

The rule a restore then sees (docs/checkpoint.md, "Completeness"): a restore still takes the
newest step that every rank can obtain, from the inventories it gathers itself; what the
agreement decides is only which older steps may be freed. Kept: the newest `keep` confirmed
steps and the two newest steps saved since. So when the background work of both of those failed
on some rank (a full disk, a lost peer) and a process then dies, the restore goes back to the
newest confirmed step, at most `AGREE_EVERY` + 1 saves older, where a per-step agreement would
have kept the newest step complete everywhere.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from restartable.checkpoint.errors import CheckpointAbandoned
from restartable.checkpoint.exchange import StoreExchange
from restartable.checkpoint.local import directory, fence, integrity, placement
from restartable.checkpoint.local.holdings import Holdings
from restartable.checkpoint.local.restore import Shard
from restartable.checkpoint.local.transport import Outgoing, transfer

log = logging.getLogger(__name__)

# One store agreement per this many saves (and at the first save of a group). A per-step
# agreement cost ~6 store round trips and a few polling wake-ups per rank and step.
AGREE_EVERY = 16


def spare_core(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this process can give a background thread a core that no training rank uses.

    A process bound to a subset of the node's CPUs (``srun --cpu-bind``, ``taskset``) is taken
    to have them to itself: spare when it has more than one. A process that may run on every
    CPU shares them with the node's other ranks (``LOCAL_WORLD_SIZE``, 1 when unset): spare
    when there are more CPUs than ranks. Linux only (``sched_getaffinity``); True elsewhere.
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return True
    ranks = 1
    if cpus >= (os.cpu_count() or cpus):
        value = environ.get("LOCAL_WORLD_SIZE", "")
        ranks = int(value) if value.isdigit() and int(value) > 0 else 1
    return cpus > ranks


@dataclass
class SaveJob:
    """One step's background work, built by LocalTier.save on the training thread."""

    shard: Shard
    # The group held weakly: a strong reference in the work item would keep a restart's
    # destroyed group, and its sockets, alive.
    pg_ref: weakref.ref[dist.ProcessGroup] | None
    nodes: list[int]
    # (this attempt's exchange, the previous one) on agreement saves, else None.
    agree: tuple[StoreExchange, StoreExchange | None] | None


class BackgroundSaver:
    """Does SaveJobs, one at a time and in save order: on the tier's thread, or on the training
    thread for the jobs `inline` accepts. Holds the replica placement between them."""

    def __init__(
        self, holdings: Holdings, local_dir: Path | None, factor: int, *, spare_core: bool
    ) -> None:
        self._hold = holdings
        self._dir = local_dir
        # Without a spare core the directory's write runs on the training thread (see inline).
        self._dir_in_background = local_dir is not None and spare_core
        self._factor = factor
        self._placement: tuple[list[int], list[list[int]], list[list[int]]] | None = None
        self._warned_factor = False
        self._files = directory.ShardFiles(local_dir) if local_dir is not None else None
        self._prunes = 0  # directory prunes so far: every AGREE_EVERY-th also sweeps

    def inline(self, job: SaveJob) -> bool:
        """Whether the training thread runs `job` itself: no replica and no agreement (neither
        of which may block the training thread), and no node-local file unless this process
        has no spare core (`spare_core`).

        With memory only, what is left between agreements is bookkeeping, and a thread wake-up
        per step cost more than it. The file's checksum and ``pwrite`` (about 0.4 ms for the
        example's 1.6 MB) are real work, which a background thread takes off the training
        thread's path only when it has a core of its own. When every core has a training rank
        on it, that thread takes its CPU from a training rank (and the collectives make every
        rank wait for that one), and it paid a thread wake-up and cache misses on top: 0.7 ms
        of thread CPU per step in the 2-rank step benchmark on 2 cores (docs/performance.md).
        """
        if job.agree is not None:
            return False
        if self._dir_in_background:
            return False
        return job.pg_ref is None or self._effective_factor(job.nodes, job.shard.owner) == 1

    def run(self, job: SaveJob) -> None:
        """Checksum, directory write, replication, then (agreement saves) the agreement.

        The checksum is computed once here, only when a file or a replica needs it; a memory
        copy is trusted, and one sent to a peer during a restore is checksummed then
        (restore.Shard.meta)."""
        t0 = time.perf_counter()
        shard = job.shard
        distributed = job.pg_ref is not None and shard.world > 1
        replicating = distributed and self._effective_factor(job.nodes, shard.owner) > 1
        if self._dir is not None or replicating:
            shard.checksum = integrity.of(shard.buf, shard.nbytes)
        ok = self._write(shard, "")
        if distributed:
            assert job.pg_ref is not None
            try:
                ok = self._replicate(shard, job.pg_ref, job.nodes) and ok
            except CheckpointAbandoned:
                log.info("local save of step %d abandoned (restart)", shard.step)
                return
            except Exception as e:  # a dead peer, a restart, a torn-down group: incomplete
                log.warning(
                    "local save of step %d on rank %d: replication failed: %s",
                    shard.step,
                    shard.owner,
                    e,
                )
                ok = False
        if ok:
            self._hold.mark_ok(shard.step)
        else:
            log.warning("local step %d is incomplete on rank %d", shard.step, shard.owner)
        if not distributed:
            if ok:
                self._hold.confirm(shard.step)
        elif job.agree is not None and not self._agree(shard, job.agree):
            return
        self._prune_directory(shard.step)
        # DEBUG: the local tier typically saves every step; INFO would flood the log.
        log.debug(
            "local save of step %d done here (%d bytes) in %.3f s",
            shard.step,
            shard.nbytes,
            time.perf_counter() - t0,
        )

    def _agree(self, shard: Shard, agree: tuple[StoreExchange, StoreExchange | None]) -> bool:
        """The store agreement (see the module docstring); False when it was abandoned."""
        ex, previous = agree
        try:
            offers = ex.gather("ok", self._hold.offered())
            if offers is not None:  # rank 0
                if previous is not None:  # every rank is past the previous verdict
                    previous.discard("verdict")
                common = set.intersection(*(set(o) for o in offers))
                ex.publish("verdict", max(common) if common else -1)
            verdict = int(ex.receive("verdict"))
        except CheckpointAbandoned:
            log.info("local save of step %d abandoned (restart)", shard.step)
            return False
        except Exception as e:
            log.warning("local agreement of step %d failed: %s", shard.step, e)
            return True
        if verdict >= 0:
            self._hold.confirm(verdict)
        else:
            log.warning("no recent local step is complete on every rank (step %d)", shard.step)
        return True

    def _write(self, shard: Shard, what: str) -> bool:
        """Write a shard to the node-local directory, if any; False (logged) when it failed."""
        if self._files is None:
            return True
        try:
            self._files.write(shard.meta(), shard.buf)
        except Exception as e:  # never skip the agreement: peers would wait on us
            log.warning(
                "local save of step %d: writing %sshard of rank %d to %s failed: %s",
                shard.step,
                what,
                shard.owner,
                self._dir,
                e,
            )
            return False
        return True

    def _prune_directory(self, step: int) -> None:
        """Free this process's files of the steps no longer kept; every AGREE_EVERY-th time
        (the first included) also remove such files that processes now gone left behind."""
        if self._files is None:
            return
        confirmed, first_recent = self._hold.disk_kept()
        below = min(first_recent, step)

        def kept(s: int) -> bool:
            return s >= below or s in confirmed

        self._files.release(kept)
        if self._prunes % AGREE_EVERY == 0:
            try:
                removed = self._files.sweep(kept)
            except OSError as e:
                log.warning(
                    "local_dir %s: removing files of ended processes failed: %s", self._dir, e
                )
            else:
                if removed:
                    log.info(
                        "local_dir %s: removed %d files of ended processes", self._dir, removed
                    )
        self._prunes += 1

    def quarantine(self, after: int, name: str) -> list[tuple[int, Path]]:
        """Move the directory's files of steps newer than ``after`` into
        ``<local_dir>/quarantine/<name>/`` (see ``directory.ShardFiles.quarantine``); none
        without a directory. Only while no job runs (the tier settled)."""
        if self._files is None or self._dir is None:
            return []
        dest = self._dir / "quarantine" / name
        try:
            fence.write(dest, after)  # first: a file written after it is the rolled-back run's
            return self._files.quarantine(after, dest)
        except OSError as e:  # the load that called it restores no later step anyway
            log.error("local_dir %s: quarantining the steps after %d failed: %s", dest, after, e)
            return []

    def close(self) -> None:
        """Close the directory's files (after the worker stopped: nothing writes any more)."""
        if self._files is not None:
            self._files.close()

    def _replicate(
        self, shard: Shard, pg_ref: weakref.ref[dist.ProcessGroup], nodes: list[int]
    ) -> bool:
        """Send this rank's shard to its peers and take theirs.

        The group is held strongly only for the transfer itself. A group destroyed by a restart
        before that (the reference is dead) abandons the step; one destroyed during it fails the
        transfer as soon as the peers closed theirs.
        """
        eff = self._effective_factor(nodes, shard.owner)
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
        ok = True
        for inc in transfer(pg, sends, inverse[shard.owner], self._hold.take):
            if inc.buf is None or inc.received != inc.checksum:
                log.warning("replica of rank %d step %d failed its checksum", inc.src, inc.step)
                ok = False
                continue
            rep = Shard(inc.step, inc.owner, inc.world, inc.nbytes, inc.checksum, inc.buf)
            self._hold.add_replica(rep)
            ok = self._write(rep, "the replica ") and ok
        return ok

    def _effective_factor(self, nodes: list[int], owner: int) -> int:
        eff = placement.effective_factor(nodes, self._factor)
        if eff < self._factor and not self._warned_factor:
            self._warned_factor = True
            # Once per job (rank 0), not once per rank: the same fact on every rank.
            log.log(
                logging.WARNING if owner == 0 else logging.DEBUG,
                "replication_factor %d needs %d nodes, the job has %d (node = host and launch "
                "node index): keeping %d cop%s per shard",
                self._factor,
                self._factor,
                placement.num_nodes(nodes),
                eff,
                "y" if eff == 1 else "ies",
            )
        return eff
