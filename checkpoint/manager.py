"""``CheckpointManager``: the one entry point; picks the tier to save to and to restore from."""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import time
from typing import Any

import torch.distributed as dist

from checkpoint import optimizers
from checkpoint.config import (
    LocalConfig,
    PersistentConfig,
    local_config,
    read_test_hooks,
    tiers_record,
)
from checkpoint.errors import CheckpointConfigError, CheckpointError, ShardingMismatchError
from checkpoint.group import BackgroundGroup
from checkpoint.local import LocalTier
from checkpoint.per_rank import keyed_by_rank
from checkpoint.persistent import (
    CheckpointDirs,
    Committed,
    PersistentSaver,
    SaveStats,
    list_committed,
    load_latest,
)
from checkpoint.rank_values import RankValuesCheck

log = logging.getLogger(__name__)
# The run journal's channel (see inprocess/journal.py; a name: checkpoint does not import it).
_journal = logging.getLogger("restartable.journal")

TIERS = ("memory", "local_dir", "peer", "persistent")


@dataclasses.dataclass(frozen=True)
class Restore:
    """What the last ``load_latest`` did: the step (None: nothing to load), tier and duration."""

    step: int | None
    tier: str | None  # one of TIERS, None when nothing was loaded
    seconds: float


class CheckpointManager:
    """Saves training state to a local tier (optional) and a persistent torch_dist tier.

    Create it once, OUTSIDE the restartable ``train()``: it survives in-process restarts (the
    local tier's memory copy is the point) and rebinds to the new default process group at the
    next ``save``/``load_latest``. ``save``, ``load_latest``, ``wait`` and ``close`` are
    COLLECTIVE: every rank calls them in the same order with the same steps. Without
    ``torch.distributed`` initialised it works as a single process.

    Example::

        with CheckpointManager("ckpts/", persistent_every=100, keep=3) as mgr:
            start = mgr.load_latest(state) or 0
            for step in range(start + 1, steps + 1):
                train_step()
                mgr.save(step, state)   # returns after staging; writes in the background

    The local tier is off unless configured, either with ``local=LocalConfig(every=1, ...)`` or
    with the keyword arguments ``local_every`` (which turns it on), ``local_dir``,
    ``replication_factor``, ``local_algo`` and ``local_keep`` (``LocalConfig``'s fields, same
    defaults); not both.
    """

    def __init__(
        self,
        root: str,
        *,
        persistent_every: int = 100,
        keep: int = 3,
        local: LocalConfig | None = None,
        local_every: int | None = None,
        local_dir: str | os.PathLike[str] | None = None,
        replication_factor: int | None = None,
        local_algo: str | None = None,
        local_keep: int | None = None,
        timeout: float = 600.0,
        fallback_on_corruption: bool = True,
        on_busy: str = "wait",
    ) -> None:
        root = str(root) if root is not None else root  # accept os.PathLike
        self._cfg = PersistentConfig(
            root=root,
            every=persistent_every,
            keep=keep,
            timeout=timeout,
            fallback_on_corruption=fallback_on_corruption,
            on_busy=on_busy,
        )
        self._local_cfg = local_config(
            local,
            local_every=local_every,
            local_dir=local_dir,
            replication_factor=replication_factor,
            local_algo=local_algo,
            local_keep=local_keep,
        )
        self._dirs = CheckpointDirs(self._cfg.root)
        self._dirs.check_writable()
        self._group = BackgroundGroup(timeout=self._cfg.timeout, name="persistent")
        self._persistent = PersistentSaver(self._cfg, self._dirs, self._group, read_test_hooks())
        self._local: LocalTier | None = None
        self._local_group: BackgroundGroup | None = None
        self._closed = False
        self._told_tiers = False  # the journal's one "tiers" record (config.tiers_record)
        self._rank_values = RankValuesCheck()  # plain values that differ between ranks
        self.last_restore: Restore | None = None
        # A persistent save that was due but never committed (a fault cancelled it): the next
        # save() writes the persistent tier whatever its interval (see _owe_persistent).
        self._persistent_owed: int | None = None
        # Closed at interpreter exit if the user did not: the save in flight is then finished or
        # abandoned, and the log says which. The hook holds the manager until close(): one
        # dropped with a save in flight would otherwise leave its writer blocked on peers while
        # the interpreter tears torch down under it (SIGABRT at exit).
        atexit.register(self._close_at_exit)
        if self._local_cfg is not None:
            self._open_local(self._local_cfg)

    def _open_local(self, cfg: LocalConfig) -> None:
        """The constructor's last step: start the local tier (its thread and group); on a
        failure, close what the constructor started and re-raise."""
        # The local tier gets its OWN dedicated group: two background threads must never
        # share one.
        self._local_group = BackgroundGroup(timeout=self._cfg.timeout, name="local")
        try:
            self._local = LocalTier(
                local_dir=cfg.dir,
                replication_factor=cfg.replication_factor,
                algo=cfg.algo,
                keep=cfg.keep,
                group=self._local_group,
                timeout=self._cfg.timeout,
                overlap=cfg.overlap_copy,
            )
        except BaseException:
            self.close()
            raise

    # -- properties ----------------------------------------------------------------------------

    @property
    def root(self) -> str:
        return self._cfg.root

    @property
    def last_save(self) -> SaveStats | None:
        """Stats of the last persistent save that finished (stall, write time, bytes, path)."""
        return self._persistent.last

    @property
    def save_in_flight(self) -> bool:
        """True while a persistent save is still being written in the background."""
        return self._persistent.in_flight

    def committed(self) -> list[Committed]:
        """Committed persistent checkpoints, oldest first (rank-local listing, not collective)."""
        return self._dirs.list_committed()

    def latest_step(self) -> int | None:
        """Newest committed persistent step (rank-local listing), or None."""
        found = self._dirs.list_committed()
        return found[-1].step if found else None

    # -- save / load ---------------------------------------------------------------------------

    def save(self, step: int, state: dict[str, Any], *, force_persistent: bool = False) -> None:
        """Save ``state`` for ``step`` to the tiers whose interval divides ``step``.

        COLLECTIVE. ``force_persistent=True`` (same value on every rank) also writes the
        persistent tier whatever its interval, e.g. for a preemption checkpoint. Returns once the
        state is staged (host copy); writes continue in the background. A second save while a
        persistent one is in flight waits for it (default ``on_busy="wait"``) or is skipped
        (``on_busy="skip"``). A failed earlier background
        save raises here (or from ``wait()``) as ``CheckpointRankError`` on every rank.
        """
        self._check_open("save")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointConfigError(
                f"step ({step!r}) must be an integer >= 0: pass the training iteration number"
            )
        if not isinstance(state, dict):
            raise CheckpointConfigError(
                f"state ({type(state).__name__}) must be a dict: wrap it, e.g. "
                "{'model': model, 'optimizer': optimizer}"
            )
        t0 = time.perf_counter()
        tiers = []
        local_due = self._local_cfg is not None and step % self._local_cfg.every == 0
        if self._local is not None and local_due:
            self._local.save(step, state)
            tiers.append("local")
        owed = self._persistent_owed is not None and step >= self._persistent_owed
        persistent_due = force_persistent or step % self._cfg.every == 0 or owed
        self._rank_values.at_save(state, step=step, persistent=persistent_due)
        if persistent_due:
            with keyed_by_rank(state, _rank()):
                if self._persistent.save(step, state):
                    tiers.append("persistent")
                    self._persistent_owed = None
        if tiers and _journal.handlers:
            stall = time.perf_counter() - t0
            _journal.debug(
                "save", extra={"journal": {"step": step, "tiers": tiers, "stall_s": stall}}
            )
        if not self._told_tiers and _journal.handlers:
            self._told_tiers = True
            _journal.debug("tiers", extra={"journal": tiers_record(self._local_cfg, self._cfg)})

    def load_latest(self, state: dict[str, Any]) -> int | None:
        """Fill ``state`` in place from the newest checkpoint of any tier; its step, or None.

        COLLECTIVE. Waits for saves in flight first. The local tier is asked for a step at
        least as new as the newest committed persistent one; otherwise the persistent tier
        loads (verifying checksums, falling back past a corrupt checkpoint with a WARNING
        unless ``fallback_on_corruption=False``). A ``torch.optim`` optimizer of ``state`` that
        has not stepped yet gets its state tensors first (``checkpoint/optimizers.py``), so that
        its saved state is restored; with nothing to load it is left without state.
        """
        self._check_open("load_latest")
        t0 = time.perf_counter()
        fresh = optimizers.prepare(state)
        step = self._load(state, t0)
        if step is None:
            optimizers.forget(fresh)
        return step

    def _load(self, state: dict[str, Any], t0: float) -> int | None:
        self._persistent.settle_after_restart()
        # A save abandoned at the restart may be past its commit decision: wait (bounded) until
        # it stopped, so the listing below already shows it if it committed. Otherwise it could
        # commit after the listing, and the next save would reuse its step over a newer commit.
        self._persistent.drain_abandoned()
        try:
            self._persistent.wait()
        except CheckpointError as e:
            # Every rank sees the same failure; the previous commit is still the latest, and
            # restoring from it is exactly what the caller asked for.
            log.error("checkpoint: the save in flight failed; loading anyway: %s", str(e))
        group = self._group.current()
        committed = list_committed(self._dirs, group)
        newest = committed[-1].step if committed else None
        if self._local is not None:
            # load() settles first: after a restart it cancels the background work in flight
            # instead of waiting on a peer that may be gone.
            try:
                result = self._local.load(state, min_step=newest)
            except ShardingMismatchError as e:  # raised on every rank, before any write
                log.warning(
                    "checkpoint: the local tier's shards do not fit the live mesh (%s); "
                    "loading the persistent tier, which reshards",
                    e,
                )
                result = None
            if result is not None:
                self._owe_persistent(int(result.step), newest)
                self._restored(int(result.step), str(result.tier), float(result.seconds))
                log.info(
                    "checkpoint: restored step %d from the %s tier in %.3f s",
                    result.step,
                    result.tier,
                    result.seconds,
                )
                return int(result.step)
        with keyed_by_rank(state, _rank()):
            ckpt = load_latest(
                self._dirs, state, group, fallback_on_corruption=self._cfg.fallback_on_corruption
            )
        seconds = time.perf_counter() - t0
        if ckpt is None:
            self._restored(None, None, seconds)
            log.info("checkpoint: no checkpoint under %s; starting fresh", self._cfg.root)
            return None
        self._restored(ckpt.step, "persistent", seconds)
        return ckpt.step

    def _owe_persistent(self, step: int, newest: int | None) -> None:
        """After a restore of ``step`` from the local tier: when the persistent tier misses a
        step that was due at or before it (its save was cancelled by the fault, or never
        committed), the next save writes it instead of waiting a whole interval. Otherwise a
        later shrink, whose ranks cannot use the local tier, would go back further than one
        persistent interval (found with the demo: a fault at step 50 cancelled the save of
        step 50, a kill at 100 the one of 100, and the job resumed from step 0).

        Every rank computes the same answer: ``step`` and ``newest`` are agreed collectively.
        """
        due = step - step % self._cfg.every
        if due > 0 and (newest is None or newest < due):
            self._persistent_owed = step
            log.info(
                "checkpoint: the persistent tier's newest step is %s but step %d was due: the "
                "next save (after step %d) writes the persistent tier",
                "none" if newest is None else newest,
                due,
                step,
            )

    def _restored(self, step: int | None, tier: str | None, seconds: float) -> None:
        self.last_restore = Restore(step=step, tier=tier, seconds=seconds)
        if _journal.handlers:
            fields = {"step": step, "tier": tier, "seconds": seconds}
            _journal.debug("restore", extra={"journal": fields})

    def before_write(self) -> None:
        """Before an in-place write of the state outside an optimizer's step: see overlap_copy."""
        if self._local is not None:
            self._local.before_write()

    def wait(self) -> None:
        """Wait (bounded) for background saves of every tier; raise the first failure."""
        self._check_open("wait")
        if self._local is not None:
            self._local.wait()
        self._persistent.wait()

    def close(self) -> None:
        """Finish or abandon the saves in flight, stop every thread, free buffers. Idempotent.

        A save in flight is finished when its process group is still current (every rank of it
        can take part), else abandoned; the log says which, and failures are logged, not raised.
        Called at interpreter exit (with a WARNING) if the program did not call it.
        """
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._close_at_exit)
        try:
            if self._local is not None:
                self._local.close()
        finally:
            self._persistent.close()
            self._group.close()
            if self._local_group is not None:
                self._local_group.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _close_at_exit(self) -> None:
        log.warning(
            "checkpoint: the CheckpointManager of %s was not closed before interpreter exit: "
            "closing it now (call close(), or use it as a context manager)",
            self.root,
        )
        self.close()

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise CheckpointError(f"CheckpointManager.{what}() called after close()")


def _rank() -> int:
    """This rank in the default group (0 without torch.distributed): the key of its PerRank."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
