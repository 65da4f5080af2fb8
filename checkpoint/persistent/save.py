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

This module holds the training thread's side (``PersistentSaver``); the phases above are
``checkpoint.persistent.protocol.SaveProtocol``'s, and a save's data travels between the two as a
``checkpoint.persistent.save_job.SaveJob``.

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
import logging
import os
import threading
import time
from typing import Any

from restartable.checkpoint.config import PersistentConfig, TestHooks
from restartable.checkpoint.errors import CheckpointError
from restartable.checkpoint.exchange import Attempts
from restartable.checkpoint.group import BackgroundGroup
from restartable.checkpoint.persistent.layout import CheckpointDirs
from restartable.checkpoint.persistent.protocol import METADATA_FILE, SaveProtocol
from restartable.checkpoint.persistent.save_job import Failed, SaveJob, SaveStats
from restartable.checkpoint.persistent.staging import StagingPool
from restartable.checkpoint.worker import BackgroundWorker

log = logging.getLogger(__name__)

__all__ = ["CRASH_POINTS", "METADATA_FILE", "WRITER_NICE", "PersistentSaver", "SaveStats"]
# The writer thread's niceness (Linux). A trade-off measured with every core busy training
# (benchmarks/checkpoint_stall.py, 2 ranks on 2 cores, 1 GiB each): nice 19 starved the write
# (durable after 135 s of training, steps 1.03x slower); nice 10 gave steps 0.99-1.16x slower
# and durable after 14-28 s. With a core to spare the write is not held back (1 rank: ~3 s).
WRITER_NICE = 10
_STOP_GRACE_S = 5.0  # close(): how long the worker may take to end once its work is settled
CRASH_POINTS = ("agree", "write", "before_commit", "commit", "retention")


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
        self._group = group
        self._pool = StagingPool()
        self._protocol = SaveProtocol(config, dirs, hooks)  # the worker thread's only
        self._worker = BackgroundWorker("ckpt-persistent", initializer=_lower_priority)
        self._pending: concurrent.futures.Future[SaveStats | Failed] | None = None
        self._pending_job: SaveJob | None = None
        # A save cancelled by a restart: not waited for by the restart, only before the
        # staging buffers it may still read are reused (next save) and at close().
        self._abandoned: concurrent.futures.Future[SaveStats | Failed] | None = None
        self._attempts = Attempts("persistent", timeout=config.timeout)
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
        job = SaveJob(step, staged, stage_error, exchange, previous, stats)
        self._pending_job = job
        self._pending = self._worker.submit(self._protocol.run, job)
        if stage_error is not None:
            # The job still runs so peers learn of the failure in `plan` instead of waiting.
            raise CheckpointError(f"save of step {step}: {stage_error}") from staging_exc
        log.debug("checkpoint: staged step %d in %.3f s", step, stats.stall_s)
        return True

    def refuse_after(self, step: int | None) -> None:
        """From now on, commit no save of a step after ``step`` (None: commit every step again).

        Training thread, rank-local, never blocks: a save in flight fails at its commit (its
        failure is reported like any failed save), or has committed already and is quarantined
        by the next ``load_latest`` (``checkpoint.quarantine``)."""
        self._protocol.refuse_after = step

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
        if isinstance(outcome, Failed):
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
        if isinstance(outcome, Failed):
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
            self._protocol.clear()


def _lower_priority() -> None:
    """Run the writer thread at a lower CPU priority (Linux: per-thread nice), so that when
    cores are scarce the training thread is scheduled first. Best effort."""
    import contextlib

    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
