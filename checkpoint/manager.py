"""``CheckpointManager``: the one entry point; picks the tier to save to and to restore from."""

from __future__ import annotations

import atexit
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

from restartable.checkpoint import optimizers, quarantine
from restartable.checkpoint.config import (
    LocalConfig,
    PersistentConfig,
    local_config,
    read_test_hooks,
    tiers_record,
)
from restartable.checkpoint.errors import CheckpointConfigError, CheckpointError
from restartable.checkpoint.group import BackgroundGroup
from restartable.checkpoint.local import LocalTier
from restartable.checkpoint.per_rank import current_rank, keyed_by_rank
from restartable.checkpoint.persistent import CheckpointDirs, Committed, PersistentSaver, SaveStats
from restartable.checkpoint.rank_values import RankValuesCheck
from restartable.checkpoint.restore_choice import Restore, Tiers, restore_newest
from restartable.checkpoint.schedule import SaveSchedule

log = logging.getLogger(__name__)
# The run journal's channel (see inprocess/journal.py; a name: checkpoint does not import it).
_journal = logging.getLogger("restartable.journal")


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
        self._quarantine = quarantine.Pending()  # a finding's distrusted steps, until a load
        self.last_restore: Restore | None = None
        self._schedule = SaveSchedule(self._cfg, self._local_cfg)
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
        _check_save_args(step, state)
        t0 = time.perf_counter()
        tiers = []
        if self._local is not None and self._schedule.local_due(step):
            self._local.save(step, state)
            tiers.append("local")
        persistent_due = self._schedule.persistent_due(step, force=force_persistent)
        self._rank_values.at_save(state, step=step, persistent=persistent_due)
        if persistent_due:
            with keyed_by_rank(state, current_rank()):
                if self._persistent.save(step, state):
                    tiers.append("persistent")
                    self._schedule.persistent_saved()
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
        tiers = Tiers(
            persistent=self._persistent,
            dirs=self._dirs,
            group=self._group,
            local=self._local,
            fallback_on_corruption=self._cfg.fallback_on_corruption,
            pending=self._quarantine,
        )
        restore = self.last_restore = restore_newest(tiers, state, self._schedule, t0)
        _tell_restore(restore, self._cfg.root)
        return restore.step

    def quarantine_after(self, step: int, *, finding: Mapping[str, Any] | None = None) -> None:
        """Never restore a step after ``step`` again (silent data corruption): rank-local, at
        the finding; see ``checkpoint.quarantine`` and docs/checkpoint.md."""
        quarantine.request(self._quarantine, self._persistent, self._dirs, step, finding)

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
        """Registered by the constructor: closes the manager at interpreter exit if the user did
        not. The save in flight is then finished or abandoned, and the log says which. The hook
        holds the manager until close(): one dropped with a save in flight would otherwise leave
        its writer blocked on peers while the interpreter tears torch down under it (SIGABRT at
        exit)."""
        log.warning(
            "checkpoint: the CheckpointManager of %s was not closed before interpreter exit: "
            "closing it now (call close(), or use it as a context manager)",
            self.root,
        )
        self.close()

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise CheckpointError(f"CheckpointManager.{what}() called after close()")


def _tell_restore(restore: Restore, root: str) -> None:
    """Journal what ``load_latest`` restored, and log it (the persistent tier logs its own)."""
    if _journal.handlers:
        fields = {"step": restore.step, "tier": restore.tier, "seconds": restore.seconds}
        _journal.debug("restore", extra={"journal": fields})
    if restore.step is None:
        log.info("checkpoint: no checkpoint under %s; starting fresh", root)
    elif restore.tier != "persistent":
        log.info(
            "checkpoint: restored step %d from the %s tier in %.3f s",
            restore.step,
            restore.tier,
            restore.seconds,
        )


def _check_save_args(step: object, state: object) -> None:
    """``save``'s arguments, checked before any tier sees them (the user's mistakes, named)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointConfigError(
            f"step ({step!r}) must be an integer >= 0: pass the training iteration number"
        )
    if not isinstance(state, dict):
        raise CheckpointConfigError(
            f"state ({type(state).__name__}) must be a dict: wrap it, e.g. "
            "{'model': model, 'optimizer': optimizer}"
        )
