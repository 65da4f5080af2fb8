"""Persistent tier save path: stage on the caller's thread, write and commit in the background.

Call order per save (every rank, same step): ``PersistentSaver.save()`` on the training thread
waits for the previous save (policy ``on_busy``), binds to the current process group (collective
after a restart), stages into reused host buffers and returns. A single long-lived worker thread
then runs the DCP save protocol, coordinating the ranks through the job's store
(``StoreExchange``), never through a process group:

1. ``start``   rank 0 picks a fresh directory, creates it with its in-progress marker and
               publishes the path.
2. ``plan``    every rank's DCP local plan (or its staging error) goes to rank 0, which builds
               the global plan (DCP's planner: dedup, file names) and hands each rank its part;
               a staging failure on any rank fails the save on every rank before data is written.
3. ``write``   each rank writes its data files (each fsynced, its CRC32 recorded as written);
               outcomes, checksums and DCP write results go to rank 0, which writes DCP's
               ``.metadata`` and then our commit marker LAST (the checkpoint becomes visible),
               and publishes the commit outcome.
4. ``retention`` rank 0 deletes checkpoints beyond ``keep`` and stale partial attempts.

A failure anywhere becomes one ``CheckpointRankError`` naming the ranks, on every rank, raised
from the next ``wait()`` / ``save()``. After an in-process restart the save in flight is
cancelled: its worker stops at its next wait or file write (milliseconds), never commits, and
the restart never waits for it.

Why a thread, not a process: what is left of the worker's work once it is arranged this way
releases the GIL (file writes, fsync, ``zlib.crc32`` on large buffers). Two things did not, and
made training steps 1.3-1.5x slower during a write in ``benchmarks/checkpoint_stall.py``:
``torch.save`` per tensor (now framed from templates, ``tensor_bytes``) and re-planning plus
unpickling every rank's plans and results at every save (now reused while unchanged,
``plan_memo``). The thread runs at a low CPU priority (``WRITER_NICE``), so when cores are
scarce the training thread gets most of them.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import secrets
import signal
import threading
import time
import traceback
from typing import Any

from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter

from checkpoint import plain
from checkpoint.config import PersistentConfig, TestHooks
from checkpoint.errors import CheckpointAbandoned, CheckpointError, CheckpointRankError
from checkpoint.exchange import Attempts, StoreExchange
from checkpoint.group import BackgroundGroup
from checkpoint.persistent.integrity import file_checksum
from checkpoint.persistent.layout import CheckpointDirs, dir_name
from checkpoint.persistent.plan_memo import PlanMemo, structure
from checkpoint.persistent.staging import StagingPool
from checkpoint.persistent.storage import make_writer, write_files
from checkpoint.persistent.tensor_bytes import ArchiveTemplates
from checkpoint.worker import BackgroundWorker

log = logging.getLogger(__name__)
# The run journal's channel (see inprocess/journal.py; a name: checkpoint does not import it).
_journal = logging.getLogger("restartable.journal")

METADATA_FILE = ".metadata"  # DCP's own metadata file (its commit point; not ours)
# The writer thread's niceness (Linux). A trade-off measured with every core busy training
# (benchmarks/checkpoint_stall.py, 2 ranks on 2 cores, 1 GiB each): nice 19 starved the write
# (durable after 135 s of training, steps 1.03x slower); nice 10 gave steps 0.99-1.16x slower
# and durable after 14-28 s. With a core to spare the write is not held back (1 rank: ~3 s).
WRITER_NICE = 10
_STOP_GRACE_S = 5.0  # close(): how long the worker may take to end once its work is settled
CRASH_POINTS = ("agree", "write", "before_commit", "commit", "retention")


@dataclasses.dataclass
class SaveStats:
    """What one persistent save did (filled in by the background job)."""

    step: int
    stall_s: float = 0.0
    write_s: float = 0.0
    bytes_written: int = 0  # this rank's data files
    path: str = ""


@dataclasses.dataclass(frozen=True)
class _Failed:
    """A background failure as data: the error class to raise on the caller's thread and args."""

    cls: type[CheckpointError]
    args: tuple[Any, ...]


@dataclasses.dataclass
class _Job:
    step: int
    staged: dict[str, Any] | None
    stage_error: str | None
    exchange: StoreExchange
    previous: StoreExchange | None  # the save before, in the same group: its keys to delete
    stats: SaveStats


class PersistentSaver:
    """Owner of the staging pool and the background writer thread of the persistent tier.

    Used from the training thread only (``save``, ``wait``, ``settle_after_restart``,
    ``close``); the worker thread is internal. Every wait is bounded by ``config.timeout``.
    """

    def __init__(
        self,
        config: PersistentConfig,
        dirs: CheckpointDirs,
        group: BackgroundGroup,
        hooks: TestHooks,
    ) -> None:
        self._cfg = config
        self._dirs = dirs
        self._group = group
        self._hooks = hooks
        self._pool = StagingPool()
        self._worker = BackgroundWorker("ckpt-persistent", initializer=_lower_priority)
        self._pending: concurrent.futures.Future[SaveStats | _Failed] | None = None
        self._pending_job: _Job | None = None
        # A save cancelled by a restart: not waited for by the restart, only before the
        # staging buffers it may still read are reused (next save) and at close().
        self._abandoned: concurrent.futures.Future[SaveStats | _Failed] | None = None
        self._attempts = Attempts("persistent", timeout=config.timeout)
        self._memo = PlanMemo()  # the worker thread's only
        self._templates = ArchiveTemplates()
        self._closed = False
        self.last: SaveStats | None = None

    @property
    def in_flight(self) -> bool:
        """True while a background save has not finished."""
        return self._pending is not None and not self._pending.done()

    def save(self, step: int, state: dict[str, Any]) -> bool:
        """Stage ``state`` for ``step`` and start the background write. Returns False if skipped.

        COLLECTIVE: every rank calls it for the same steps. Blocks while the state is copied
        (and, with ``on_busy="wait"``, until the previous save finished).
        """
        if self._closed:
            raise CheckpointError("CheckpointManager.save() called after close()")
        self.settle_after_restart()
        if self.in_flight and self._cfg.on_busy == "skip":
            log.warning("checkpoint: skipping persistent save of step %d: one in flight", step)
            return False
        self.wait()
        self.drain_abandoned()
        t0 = time.perf_counter()
        group = self._group.current()
        exchange, previous = self._attempts.next(group, self._group.token)
        stage_error = None
        staged = None
        try:
            staged = self._pool.stage(state)
        except Exception as e:
            stage_error = f"staging failed: {type(e).__name__}: {e}"
            staging_exc: Exception = e
        stats = SaveStats(step=step, stall_s=time.perf_counter() - t0)
        job = _Job(step, staged, stage_error, exchange, previous, stats)
        self._pending_job = job
        self._pending = self._worker.submit(self._run, job)
        if stage_error is not None:
            # The job still runs so peers learn of the failure in `plan` instead of waiting.
            raise CheckpointError(f"save of step {step}: {stage_error}") from staging_exc
        log.debug("checkpoint: staged step %d in %.3f s", step, stats.stall_s)
        return True

    def wait(self) -> SaveStats | None:
        """Wait (bounded) for the save in flight; raise its error, if it failed.

        The save stays "in flight" until its outcome is in: a restart that interrupts this
        wait (an exception raised into the training thread) must still find it in
        ``settle_after_restart`` and abandon it, or the worker would wait for the lost peers
        and every later save would queue behind it (found by the fault matrix under load).
        """
        fut, job = self._pending, self._pending_job
        if fut is None:
            return None
        try:
            outcome = fut.result(timeout=self._cfg.timeout * 2)
        except concurrent.futures.TimeoutError as e:
            # Stop it and tell the peers, as after a restart; the next save drains it.
            if job is not None:
                job.exchange.abandon()
            self._abandoned, self._pending, self._pending_job = fut, None, None
            raise CheckpointError(
                f"background save did not finish within {self._cfg.timeout * 2:.0f} s "
                "(2 x timeout): storage hung or a rank stopped participating"
            ) from e
        self._pending, self._pending_job = None, None
        if isinstance(outcome, _Failed):
            raise outcome.cls(*outcome.args)
        self.last = outcome
        return outcome

    def settle_after_restart(self) -> None:
        """If the process group changed since the last save, cancel the save in flight.

        Never blocks: the worker stops at its next wait or file write and the save never
        becomes visible (unless rank 0 had already committed it, in which case every rank's
        data was durable and it stays a valid checkpoint). Call at every collective entry.
        """
        if self._pending is None or not self._group.is_stale():
            return
        self._group.drop()
        if self._pending.done():  # finished before the restart: collect its outcome
            try:
                self.wait()
            except CheckpointError as e:
                log.warning("checkpoint: the save in flight at the restart failed: %s", str(e))
            return
        job = self._pending_job
        if job is not None:
            job.exchange.abandon()
            # Not yet "abandoned": rank 0 may be past its commit already. drain_abandoned()
            # says which, once the save stopped (a commit 0.1 s after an "abandoning" line
            # read as a contradiction).
            log.warning(
                "checkpoint: process group changed with the save of step %d in flight: "
                "cancelling it",
                job.step,
            )
        self._abandoned, self._pending, self._pending_job = self._pending, None, None

    def drain_abandoned(self) -> None:
        """Wait (bounded) for a cancelled save to stop: it may still read the staging buffers,
        and it may still commit (if it was past the point of no return when cancelled)."""
        fut = self._abandoned  # kept until the wait ends: an interrupted drain is redone
        if fut is None:
            return
        try:
            outcome = fut.result(timeout=self._cfg.timeout)
        except concurrent.futures.TimeoutError:
            self._abandoned = None
            log.error(
                "checkpoint: an abandoned save did not stop within %.0f s (storage hung?)",
                self._cfg.timeout,
            )
            return
        self._abandoned = None
        if isinstance(outcome, _Failed):
            log.info("checkpoint: cancelled save stopped, never visible: %s", outcome.args[0])
        else:
            log.info(
                "checkpoint: the cancelled save of step %d had committed before the cancel "
                "reached it: it stays a valid checkpoint",
                outcome.step,
            )

    def close(self) -> None:
        """Finish or abandon the save in flight, say which, and stop the worker (bounded).

        A save whose process group is still the current one is completed: every rank of it can
        still take part (waited for at most 2 x timeout, and ended at once if a peer abandons
        it). One whose group is gone (a restart, or the end of a ``@restartable`` iteration,
        tore it down) is abandoned: its peers may have left, and it never becomes visible.
        Errors are logged, not raised.
        """
        if self._closed:
            return
        self._closed = True
        job = self._pending_job
        try:
            self.settle_after_restart()
            if self._pending is not None and job is not None:
                log.info("checkpoint: close(): finishing the save of step %d in flight", job.step)
                if self.wait() is not None:
                    log.info("checkpoint: close(): the save of step %d completed", job.step)
        except CheckpointError as e:
            log.error("checkpoint: close(): the save in flight did not complete: %s", str(e))
        finally:
            self.drain_abandoned()
            # The waits above were bounded; a worker still stuck (hung storage) is a daemon and
            # must not hold the process any longer.
            self._worker.stop(timeout=_STOP_GRACE_S)
            self._pool.release()
            self._memo.clear()

    # -- background ----------------------------------------------------------------------------

    def _crash(self, point: str, rank: int) -> None:
        if self._hooks.crash_at == point and self._hooks.crash_rank in (None, rank):
            log.error("checkpoint: test hook: SIGKILL at %s on rank %d", point, rank)
            os.kill(os.getpid(), signal.SIGKILL)

    def _run(self, job: _Job) -> SaveStats | _Failed:
        # Failures travel back as plain data, not as exception objects: a traceback would keep
        # the job's frames (and the staged buffers) alive in a reference cycle after an
        # abandoned save.
        if job.exchange.cancel.is_set():
            return _Failed(CheckpointAbandoned, (f"save of step {job.step}: cancelled",))
        try:
            return self._run_job(job)
        except CheckpointRankError as e:
            return _Failed(CheckpointRankError, (e.what, e.failures))
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            text = f"save of step {job.step} failed: {_describe(e)}"
            # Text, not exc_info: a captured record would keep the traceback alive.
            log.debug("checkpoint: background save failed:\n%s", traceback.format_exc())
            return _Failed(type(e) if isinstance(e, CheckpointError) else CheckpointError, (text,))
        finally:
            job.staged = None

    def _run_job(self, job: _Job) -> SaveStats:
        ex, step, stats = job.exchange, job.step, job.stats
        rank, world = ex.rank, ex.world
        t0 = time.perf_counter()
        self._crash("agree", rank)
        if rank == 0:
            dirpath = self._dirs.join(dir_name(step, secrets.token_hex(4)))
            try:
                self._dirs.begin(dirpath, step=step, world_size=world)
                ex.publish("start", (dirpath, None))
            except Exception as e:
                ex.publish("start", (dirpath, _describe(e)))
        dirpath, start_error = ex.receive("start")
        stats.path = dirpath

        # Plan: DCP's planner, driven by hand so that the ranks meet in the store (see module
        # docstring); the files and .metadata are exactly what torch.distributed.checkpoint.save
        # writes.
        sums: dict[str, dict[str, int]] = {}
        writer = make_writer(
            self._dirs, dirpath, sums, thread_count=self._cfg.thread_count, cancel=ex.cancel
        )
        planner = DefaultSavePlanner()
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
            # Every rank posted a plan, so every rank has read "start" and the previous commit.
            ex.discard("start")
            if job.previous is not None:
                job.previous.discard("commit")
            failures = {r: err for r, (err, _) in enumerate(plans) if err is not None}
            central: list[bytes | None] = [None] * world
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
        failures, my_blob = ex.receive("global", mine=True)
        if failures:
            raise CheckpointRankError(f"save of step {step}", failures)
        my_plan = self._memo.load("central", my_blob)

        self._crash("write", rank)
        error, results = None, None
        try:
            results = write_files(writer, planner.finish_plan(my_plan), planner, self._templates)
        except BaseException as e:
            error = _describe(e)
        job.staged = None  # the pool's views; nothing else may keep them alive
        self._crash("before_commit", rank)
        results_blob = None if results is None else plain.dumps(results)
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


def _lower_priority() -> None:
    """Run the writer thread at a lower CPU priority (Linux: per-thread nice), so that when
    cores are scarce the training thread is scheduled first. Best effort."""
    import contextlib

    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)


def _describe(e: BaseException) -> str:
    """One error text for a rank's failure, with the innermost frame for context."""
    tb = traceback.extract_tb(e.__traceback__)
    where = f" (at {tb[-1].filename}:{tb[-1].lineno})" if tb else ""
    return f"{type(e).__name__}: {e}{where}"
