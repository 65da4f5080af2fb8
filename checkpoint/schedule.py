"""Which tiers a ``CheckpointManager.save`` at a step writes: each tier's interval, and a
persistent step owed after a restore from the local tier."""

from __future__ import annotations

import logging

from restartable.checkpoint.config import LocalConfig, PersistentConfig

# The manager's channel: these lines were the manager's, and printed logs show the logger name.
log = logging.getLogger("restartable.checkpoint.manager")


class SaveSchedule:
    """The save schedule of one manager (one instance per ``CheckpointManager``).

    The manager asks ``local_due`` and ``persistent_due`` at every ``save`` (local first), tells
    ``persistent_saved`` when the persistent tier accepted a save, and tells
    ``after_local_restore`` when ``load_latest`` restored from the local tier. Every rank holds
    the same schedule and feeds it the same (collectively agreed) steps, so every rank gets the
    same answers: the saves it decides are collective. Never blocks.
    """

    def __init__(self, persistent: PersistentConfig, local: LocalConfig | None) -> None:
        self._persistent_every = persistent.every
        self._local_every = None if local is None else local.every  # None: the tier is off
        # A persistent save that was due but never committed (a fault cancelled it): the next
        # save writes the persistent tier whatever its interval (see after_local_restore).
        self._persistent_owed: int | None = None

    def local_due(self, step: int) -> bool:
        """Whether a save at ``step`` writes the local tier (False when it is off)."""
        return self._local_every is not None and step % self._local_every == 0

    def persistent_due(self, step: int, *, force: bool) -> bool:
        """Whether a save at ``step`` writes the persistent tier: forced, on its interval, or
        owed since a local restore (at or after the owed step)."""
        owed = self._persistent_owed is not None and step >= self._persistent_owed
        return force or step % self._persistent_every == 0 or owed

    def persistent_saved(self) -> None:
        """The persistent tier accepted a save: nothing is owed any more."""
        self._persistent_owed = None

    def after_local_restore(self, step: int, newest: int | None) -> None:
        """After a restore of ``step`` from the local tier, with ``newest`` the newest committed
        persistent step: when the persistent tier misses a step that was due at or before it
        (its save was cancelled by the fault, or never committed), the next save writes it
        instead of waiting a whole interval. Otherwise a later shrink, whose ranks cannot use
        the local tier, would go back further than one persistent interval (found with the
        demo: a fault at step 50 cancelled the save of step 50, a kill at 100 the one of 100,
        and the job resumed from step 0).
        """
        due = step - step % self._persistent_every
        if due > 0 and (newest is None or newest < due):
            self._persistent_owed = step
            log.info(
                "checkpoint: the persistent tier's newest step is %s but step %d was due: the "
                "next save (after step %d) writes the persistent tier",
                "none" if newest is None else newest,
                due,
                step,
            )
