"""Persistent tier save path: stage on the caller's thread, write and commit in the background.

Call order per save (every rank, same step): ``PersistentSaver.save()`` on the training thread
waits for the previous save (policy ``on_busy``), binds the dedicated gloo group (collective
after a restart), stages into reused host buffers and returns. A single long-lived worker thread
then runs, on the dedicated group only:

1. ``agree``   all-gather "staged ok?" (+ rank 0's fresh directory token): a staging failure on
               any rank fails the save on every rank, before anything is written.
2. ``write``   rank 0 creates the directory + in-progress marker, then DCP planning and
               ``write_data`` (every data file fsynced, its CRC32 recorded as it is written) and
               DCP's ``finish`` (``.metadata``) on rank 0.
3. ``commit``  all-gather each rank's outcome + checksums; rank 0 writes the commit marker LAST
               (the checkpoint becomes visible), then broadcasts the commit outcome.
4. ``retention`` rank 0 deletes checkpoints beyond ``keep`` and stale partial attempts.

A failure anywhere becomes one ``CheckpointRankError`` naming the ranks, on every rank, raised
from the next ``wait()`` / ``save()``. Why a thread, not a process: the bulk of the work
(file writes, fsync, ``zlib.crc32`` on large buffers) releases the GIL; see the benchmark.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import secrets
import signal
import time
import traceback
from typing import TYPE_CHECKING, Any

from checkpoint.collectives import all_gather, broadcast, rank_and_size
from checkpoint.config import PersistentConfig, TestHooks
from checkpoint.errors import CheckpointAbandoned, CheckpointError, CheckpointRankError
from checkpoint.group import BackgroundGroup
from checkpoint.integrity import file_checksum
from checkpoint.layout import Layout, dir_name
from checkpoint.staging import StagingPool
from checkpoint.writer import make_writer

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

log = logging.getLogger(__name__)

METADATA_FILE = ".metadata"  # DCP's own metadata file (its commit point; not ours)
WRITER_NICE = 5  # niceness added to the writer thread (Linux); see _lower_priority
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
    group: ProcessGroup | None
    generation: int
    stats: SaveStats


class PersistentSaver:
    """Owner of the staging pool and the background writer thread of the persistent tier.

    Used from the training thread only (``save``, ``wait``, ``close``); the worker thread is
    internal. Every wait is bounded by ``config.timeout``.
    """

    def __init__(
        self, config: PersistentConfig, layout: Layout, group: BackgroundGroup, hooks: TestHooks
    ) -> None:
        self._cfg = config
        self._layout = layout
        self._group = group
        self._hooks = hooks
        self._pool = StagingPool()
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="ckpt-persistent", initializer=_lower_priority
        )
        self._pending: concurrent.futures.Future[SaveStats | _Failed] | None = None
        self._pending_job: _Job | None = None
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
        t0 = time.perf_counter()
        group = self._group.current()
        stage_error = None
        staged = None
        try:
            staged = self._pool.stage(state)
        except Exception as e:
            stage_error = f"staging failed: {type(e).__name__}: {e}"
            staging_exc: Exception = e
        stats = SaveStats(step=step, stall_s=time.perf_counter() - t0)
        job = _Job(step, staged, stage_error, group, self._group.generation, stats)
        self._pending_job = job
        self._pending = self._executor.submit(self._run, job)
        if stage_error is not None:
            # The job still runs so peers learn of the failure in `agree` instead of hanging.
            raise CheckpointError(f"save of step {step}: {stage_error}") from staging_exc
        log.debug("checkpoint: staged step %d in %.3f s", step, stats.stall_s)
        return True

    def wait(self) -> SaveStats | None:
        """Wait (bounded) for the save in flight; raise its error, if it failed."""
        fut, self._pending = self._pending, None
        self._pending_job = None
        if fut is None:
            return None
        try:
            outcome = fut.result(timeout=self._cfg.timeout * 2)
        except concurrent.futures.TimeoutError as e:
            raise CheckpointError(
                f"background save did not finish within {self._cfg.timeout * 2:.0f} s "
                "(2 x timeout): storage hung or a rank stopped participating"
            ) from e
        if isinstance(outcome, _Failed):
            raise outcome.cls(*outcome.args)
        self.last = outcome
        return outcome

    def settle_after_restart(self) -> None:
        """If the default group changed since the last save, finish or abandon that save.

        Destroying the old dedicated group releases the worker blocked in a collective on it;
        a save that had already committed stays committed (every rank's data was durable), any
        other is abandoned (logged, never raised, never visible). Call before ``current()``.
        """
        if self._pending is None or not self._group.is_stale():
            return
        job = self._pending_job
        self._group.drop()
        try:
            self.wait()
        except CheckpointError as e:
            step = job.step if job else "?"
            log.warning("checkpoint: abandoned save of step %s (restart): %s", step, str(e))

    def close(self) -> None:
        """Wait for the save in flight (errors are logged, not raised) and stop the worker."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()
        except CheckpointError as e:
            log.error("checkpoint: save in flight at close() failed: %s", str(e))
        finally:
            self._executor.shutdown(wait=True)
            self._pool.release()

    # -- background ----------------------------------------------------------------------------

    def _crash(self, point: str, rank: int) -> None:
        if self._hooks.crash_at == point and self._hooks.crash_rank in (None, rank):
            log.error("checkpoint: test hook: SIGKILL at %s on rank %d", point, rank)
            os.kill(os.getpid(), signal.SIGKILL)

    def _run(self, job: _Job) -> SaveStats | _Failed:
        # Failures travel back as plain data, not as exception objects: a traceback would keep
        # the job's frames (and through them the process group and its sockets) alive in a
        # reference cycle after an abandoned save; see test_checkpoint_rebind.
        if job.generation != self._group.generation:
            return _Failed(CheckpointAbandoned, (f"save of step {job.step}: group changed",))
        try:
            return self._run_job(job)
        except CheckpointRankError as e:
            return _Failed(CheckpointRankError, (e.what, e.failures))
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            text = f"save of step {job.step} failed: {_describe(e)}"
            # Text, not exc_info: a captured record would keep the traceback (and group) alive.
            log.debug("checkpoint: background save failed:\n%s", traceback.format_exc())
            return _Failed(type(e) if isinstance(e, CheckpointError) else CheckpointError, (text,))
        finally:
            job.staged = None
            job.group = None

    def _run_job(self, job: _Job) -> SaveStats:
        group, step, stats = job.group, job.step, job.stats
        rank, world = rank_and_size(group)
        t0 = time.perf_counter()
        token = secrets.token_hex(4) if rank == 0 else None
        self._crash("agree", rank)
        gathered = all_gather((job.stage_error, token), group)
        failures = {r: err for r, (err, _) in enumerate(gathered) if err is not None}
        if failures:
            raise CheckpointRankError(f"save of step {step}", failures)
        dirpath = self._layout.join(dir_name(step, gathered[0][1]))
        stats.path = dirpath

        error = None
        sums: dict[str, dict[str, int]] = {}
        try:
            if rank == 0:
                self._layout.begin(dirpath, step=step, world_size=world)
            self._crash("write", rank)
            _dcp_save(job.staged, self._layout, dirpath, sums, group, self._cfg.thread_count)
            if rank == 0:
                meta = self._layout.join_dir(dirpath, METADATA_FILE)
                crc, size = file_checksum(self._layout.fs, meta)
                sums[METADATA_FILE] = {"crc32": crc, "size": size}
        except BaseException as e:
            error = _describe(e)
        job.staged = None  # the pool's views; nothing else may keep them alive
        self._crash("before_commit", rank)
        outcomes = all_gather((error, sums), group)
        failures = {r: err for r, (err, _) in enumerate(outcomes) if err is not None}
        if failures:
            raise CheckpointRankError(f"save of step {step}", failures)

        commit_error = None
        if rank == 0:
            try:
                files: dict[str, dict[str, int]] = {}
                for _, rank_sums in outcomes:
                    files.update(rank_sums)
                manifest = {
                    "step": step,
                    "world_size": world,
                    "files": files,
                    "bytes": sum(f["size"] for f in files.values()),
                    "committed": time.time(),
                }
                self._crash("commit", rank)
                self._layout.commit(dirpath, manifest)
            except Exception as e:
                commit_error = _describe(e)
        commit_error = broadcast(commit_error, group)
        if commit_error is not None:
            raise CheckpointRankError(f"commit of step {step}", {0: commit_error})
        stats.write_s = time.perf_counter() - t0
        stats.bytes_written = sum(f["size"] for f in sums.values())
        if rank == 0:
            total = sum(sum(f["size"] for f in s.values()) for _, s in outcomes)
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

    def _retention(self, current: str) -> None:
        try:
            self._crash("retention", 0)
            self._layout.apply_retention(self._cfg.keep, protect=current)
        except Exception as e:
            # The new checkpoint is committed; a failed cleanup only costs space.
            log.warning("checkpoint: retention failed (will retry after the next save): %s", str(e))


def _dcp_save(
    staged: Any,
    layout: Layout,
    dirpath: str,
    sums: dict[str, dict[str, int]],
    group: ProcessGroup | None,
    thread_count: int,
) -> None:
    import torch.distributed.checkpoint as dcp

    writer = make_writer(layout, dirpath, sums, thread_count=thread_count)
    dcp.save(staged, storage_writer=writer, process_group=group, no_dist=group is None)


def _lower_priority() -> None:
    """Run the writer thread at a lower CPU priority (Linux: per-thread nice), so that when
    cores are scarce the training thread is scheduled first. Best effort."""
    import contextlib
    import threading

    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)


def _describe(e: BaseException) -> str:
    """One error text for a rank's failure, with the innermost frame for context."""
    tb = traceback.extract_tb(e.__traceback__)
    where = f" (at {tb[-1].filename}:{tb[-1].lineno})" if tb else ""
    return f"{type(e).__name__}: {e}{where}"
