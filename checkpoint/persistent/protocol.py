"""The persistent tier's save protocol, run by the writer thread (see ``checkpoint.persistent.save``
for the phases: start, plan, write, commit, retention).

``SaveProtocol.run`` is called by ``PersistentSaver``'s single background worker, one save at a
time, never on the training thread. Every rank runs it for the same save; the ranks meet only in
the job's store (``StoreExchange``), whose waits are bounded by the config's ``timeout`` and end
at once when the save is cancelled (``exchange.cancel``). Files are written, fsynced and
checksummed here; rank 0 commits.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import time
import traceback
from typing import Any

from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter

from restartable.checkpoint import plain
from restartable.checkpoint.config import PersistentConfig, TestHooks
from restartable.checkpoint.errors import CheckpointAbandoned, CheckpointError, CheckpointRankError
from restartable.checkpoint.exchange import StoreExchange
from restartable.checkpoint.persistent.integrity import file_checksum
from restartable.checkpoint.persistent.layout import CheckpointDirs, dir_name
from restartable.checkpoint.persistent.object_bytes import ObjectArchives
from restartable.checkpoint.persistent.plan_memo import PlanMemo, structure
from restartable.checkpoint.persistent.save_job import Failed, SaveJob, SaveStats
from restartable.checkpoint.persistent.storage import make_writer, write_files
from restartable.checkpoint.persistent.tensor_bytes import ArchiveTemplates

log = logging.getLogger(__name__)
# The run journal's channel (see inprocess/journal.py; a name: checkpoint does not import it).
_journal = logging.getLogger("restartable.journal")

METADATA_FILE = ".metadata"  # DCP's own metadata file (its commit point; not ours)


class SaveProtocol:
    """One rank's side of every persistent save; keeps what saves reuse (decoded plans,
    archive templates). Used by the writer thread only."""

    def __init__(self, config: PersistentConfig, dirs: CheckpointDirs, hooks: TestHooks) -> None:
        self._cfg = config
        self._dirs = dirs
        self._hooks = hooks
        self._memo = PlanMemo()  # the worker thread's only
        self._templates = ArchiveTemplates()
        self._objects = ObjectArchives()
        # Set by the training thread (PersistentSaver.refuse_after), read by this one before
        # the commit: a step newer than it is distrusted (a finding of silent data corruption)
        # and never committed. A plain int swap: the commit checks it last, and a commit that
        # raced past the check is quarantined by the next load (checkpoint.quarantine).
        self.refuse_after: int | None = None

    def clear(self) -> None:
        """Forget the reused plans (``PersistentSaver.close``, once the worker stopped)."""
        self._memo.clear()

    def _crash(self, point: str, rank: int) -> None:
        if self._hooks.crash_at == point and self._hooks.crash_rank in (None, rank):
            log.error("checkpoint: test hook: SIGKILL at %s on rank %d", point, rank)
            os.kill(os.getpid(), signal.SIGKILL)

    def run(self, job: SaveJob) -> SaveStats | Failed:
        """The save of ``job`` (writer thread): its stats, or its failure as data."""
        # Failures travel back as plain data, not as exception objects: a traceback would keep
        # the job's frames (and the staged buffers) alive in a reference cycle after an
        # abandoned save.
        if job.exchange.cancel.is_set():
            return Failed(CheckpointAbandoned, (f"save of step {job.step}: cancelled",))
        try:
            return self._run_job(job)
        except CheckpointRankError as e:
            return Failed(CheckpointRankError, (e.what, e.failures))
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            text = f"save of step {job.step} failed: {_describe(e)}"
            # Text, not exc_info: a captured record would keep the traceback alive.
            log.debug("checkpoint: background save failed:\n%s", traceback.format_exc())
            return Failed(type(e) if isinstance(e, CheckpointError) else CheckpointError, (text,))
        finally:
            job.staged = None

    def _run_job(self, job: SaveJob) -> SaveStats:
        ex, step, stats = job.exchange, job.step, job.stats
        rank, world = ex.rank, ex.world
        t0 = time.perf_counter()
        self._crash("agree", rank)
        dirpath, start_error = self._start(ex, step)
        stats.path = dirpath
        # Plan: DCP's planner, driven by hand so that the ranks meet in the store (see
        # checkpoint.persistent.save); the files and .metadata are exactly what
        # torch.distributed.checkpoint.save writes.
        sums: dict[str, dict[str, int]] = {}
        writer = make_writer(
            self._dirs, dirpath, sums, thread_count=self._cfg.thread_count, cancel=ex.cancel
        )
        planner = DefaultSavePlanner()
        my_blob, metadata = self._plan(job, planner, writer, start_error)
        outcomes = self._write(job, planner, writer, my_blob, sums, metadata, dirpath)
        stats.write_s = time.perf_counter() - t0
        stats.bytes_written = sum(f["size"] for f in sums.values())
        if _journal.handlers:
            fields = {"step": step, "write_s": stats.write_s, "bytes": stats.bytes_written}
            _journal.debug("save_durable", extra={"journal": {**fields, "path": dirpath}})
        if outcomes is not None:
            total = sum(sum(f["size"] for f in s.values()) for _, s, _ in outcomes)
            log.info(
                "checkpoint: saved step %d to %s: %d ranks, %.1f MiB, stall %.3f s, "
                "write+commit %.2f s",
                step,
                dirpath,
                world,
                total / 2**20,
                stats.stall_s,
                stats.write_s,
            )
            self._retention(dirpath)
        return stats

    def _start(self, ex: StoreExchange, step: int) -> tuple[str, str | None]:
        """``start``: rank 0 creates the directory with its in-progress marker and publishes
        it; every rank gets the path and rank 0's error (None when it worked)."""
        if ex.rank == 0:
            dirpath = self._dirs.join(dir_name(step, secrets.token_hex(4)))
            try:
                self._dirs.begin(dirpath, step=step, world_size=ex.world)
                ex.publish("start", (dirpath, None))
            except Exception as e:
                ex.publish("start", (dirpath, _describe(e)))
        dirpath, start_error = ex.receive("start")
        return dirpath, start_error

    def _plan(
        self, job: SaveJob, planner: SavePlanner, writer: StorageWriter, start_error: str | None
    ) -> tuple[bytes, Any]:
        """``plan``: every rank's local plan (or error) to rank 0, which hands each rank its
        part of the global plan. Returns this rank's part, encoded, and (rank 0) the metadata;
        raises ``CheckpointRankError`` on every rank when any rank failed to stage or plan."""
        ex, rank, world = job.exchange, job.exchange.rank, job.exchange.world
        error = job.stage_error or (start_error if rank == 0 else None)
        # Plans and results travel as plain data (checkpoint.plain, never pickle: they are read
        # from the store) and as bytes, so that rank 0 can tell unchanged ones from their
        # bytes and skip decoding and re-planning them (see plan_memo).
        plan_blob = None
        if error is None and start_error is None:
            try:
                plan_blob = self._local_plan(planner, writer, job.staged, rank, world)
            except BaseException as e:
                error = _describe(e)
        plans = ex.gather("plan", (error, plan_blob))
        metadata = None
        if plans is not None:  # rank 0
            metadata = self._global(job, planner, writer, plans)
        failures, my_blob = ex.receive("global", mine=True)
        if failures:
            raise CheckpointRankError(f"save of step {job.step}", failures)
        return my_blob, metadata

    def _global(
        self, job: SaveJob, planner: SavePlanner, writer: StorageWriter, plans: list[Any]
    ) -> Any:
        """Rank 0: the global plan from every rank's (error, plan), each rank's part published
        to it; returns the checkpoint metadata (None when a rank failed)."""
        ex, world = job.exchange, job.exchange.world
        # Every rank posted a plan, so every rank has read "start" and the previous commit.
        ex.discard("start")
        if job.previous is not None:
            job.previous.discard("commit")
        failures = {r: err for r, (err, _) in enumerate(plans) if err is not None}
        central: list[bytes | None] = [None] * world
        metadata = None
        if not failures:
            try:
                central, metadata = self._memo.derive(
                    "global",
                    tuple(b for _, b in plans),
                    lambda: _global_plan(planner, writer, plans),
                )
            except BaseException as e:
                failures = {0: _describe(e)}
        for r in range(world):
            ex.publish("global", (failures, central[r]), to=r)
        return metadata

    def _write(
        self,
        job: SaveJob,
        planner: DefaultSavePlanner,
        writer: StorageWriter,
        my_blob: bytes,
        sums: dict[str, dict[str, int]],
        metadata: Any,
        dirpath: str,
    ) -> list[Any] | None:
        """``write`` and ``commit``: this rank's files, then every rank's outcome to rank 0,
        which commits. Returns every rank's outcome on rank 0 (None elsewhere); raises
        ``CheckpointRankError`` on every rank when a write or the commit failed."""
        ex, step, rank, world = job.exchange, job.step, job.exchange.rank, job.exchange.world
        self._crash("write", rank)
        error, results_blob = None, None
        try:
            plan = planner.finish_plan(self._memo.load("central", my_blob))
            results = write_files(writer, plan, planner, self._templates, self._objects)
            # Write results are a function of the plan and each item's length (write_files):
            # while both are unchanged, so is their encoding (~3 ms of the writer's CPU).
            key = (my_blob, tuple(r.size_in_bytes for r in results))
            results_blob = self._memo.derive("results", key, lambda: plain.dumps(results))
        except BaseException as e:
            error = _describe(e)
        job.staged = None  # the pool's views; nothing else may keep them alive
        self._crash("before_commit", rank)
        outcomes = ex.gather("write", (error, sums, results_blob))
        if outcomes is not None:  # rank 0
            what = f"save of step {step}"
            failures = {r: err for r, (err, _, _) in enumerate(outcomes) if err is not None}
            if not failures:
                what = f"commit of step {step}"
                try:
                    self._commit(writer, metadata, dirpath, step, world, outcomes)
                except Exception as e:
                    failures = {0: _describe(e)}
            ex.publish("commit", (what, failures))
        what, failures = ex.receive("commit")
        if failures:
            raise CheckpointRankError(what, failures)
        return outcomes

    def _local_plan(
        self, planner: SavePlanner, writer: StorageWriter, staged: Any, rank: int, world: int
    ) -> bytes:
        """This rank's DCP save plan, encoded by ``checkpoint.plain`` (what
        ``torch.distributed.checkpoint.save`` does first). Planning again is skipped while the
        staged tree's structure is unchanged."""
        planner.set_up_planner(
            state_dict=staged, storage_meta=writer.storage_meta(), is_coordinator=rank == 0
        )
        writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)

        def plan() -> tuple[Any, bytes]:
            local = planner.create_local_plan()
            return local, plain.dumps(local)

        local, blob = self._memo.derive("local", (rank, world, structure(staged)), plan)
        writer.prepare_local_plan(local)  # creates the directory on this rank's view of storage
        return blob

    def _commit(
        self,
        writer: StorageWriter,
        metadata: Any,
        dirpath: str,
        step: int,
        world: int,
        outcomes: list[Any],
    ) -> None:
        """Rank 0, every rank's data durable: DCP's .metadata, then our commit marker LAST."""
        results = [self._memo.load(("results", r), blob) for r, (_, _, blob) in enumerate(outcomes)]
        writer.finish(metadata=metadata, results=results)
        files: dict[str, dict[str, int]] = {}
        for _, rank_sums, _ in outcomes:
            files.update(rank_sums)
        crc, size = file_checksum(self._dirs.fs, self._dirs.join_dir(dirpath, METADATA_FILE))
        files[METADATA_FILE] = {"crc32": crc, "size": size}
        manifest = {
            "step": step,
            "world_size": world,
            "files": files,
            "bytes": sum(f["size"] for f in files.values()),
            "committed": time.time(),
        }
        self._crash("commit", 0)
        refused = self.refuse_after
        if refused is not None and step > refused:
            raise CheckpointError(
                f"step {step} not committed: a finding of silent data corruption distrusts "
                f"every step after {refused} (the job rolls back there)"
            )
        self._dirs.commit(dirpath, manifest)

    def _retention(self, current: str) -> None:
        try:
            self._crash("retention", 0)
            self._dirs.apply_retention(self._cfg.keep, protect=current)
        except Exception as e:
            # The new checkpoint is committed; a failed cleanup only costs space.
            log.warning("checkpoint: retention failed (will retry after the next save): %s", str(e))


def _global_plan(
    planner: SavePlanner, writer: StorageWriter, plans: list[tuple[Any, bytes]]
) -> tuple[list[bytes], Any]:
    """Rank 0: DCP's global plan from every rank's encoded local plan: each rank's part,
    encoded, and the checkpoint metadata (``writer.finish`` fills in its storage data)."""
    central, metadata = planner.create_global_plan([plain.loads(b) for _, b in plans])
    return [plain.dumps(p) for p in writer.prepare_global_plan(central)], metadata


def _describe(e: BaseException) -> str:
    """One error text for a rank's failure, with the innermost frame for context."""
    tb = traceback.extract_tb(e.__traceback__)
    where = f" (at {tb[-1].filename}:{tb[-1].lineno})" if tb else ""
    return f"{type(e).__name__}: {e}{where}"
