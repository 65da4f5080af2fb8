"""The restore choice of ``CheckpointManager.load_latest``: which tier to restore from, and the
load from it."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from restartable.checkpoint import quarantine
from restartable.checkpoint.errors import CheckpointError, ShardingMismatchError
from restartable.checkpoint.group import BackgroundGroup
from restartable.checkpoint.local import LocalTier
from restartable.checkpoint.per_rank import current_rank, keyed_by_rank
from restartable.checkpoint.persistent import (
    CheckpointDirs,
    PersistentSaver,
    list_committed,
    load_latest,
)
from restartable.checkpoint.schedule import SaveSchedule

# The manager's channel: these lines were the manager's, and printed logs show the logger name.
log = logging.getLogger("restartable.checkpoint.manager")

TIERS = ("memory", "local_dir", "peer", "persistent")


@dataclasses.dataclass(frozen=True)
class Restore:
    """What the last ``load_latest`` did: the step (None: nothing to load), tier and duration."""

    step: int | None
    tier: str | None  # one of TIERS, None when nothing was loaded
    seconds: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class Tiers:
    """The tiers of one manager that a restore reads, and how it reads them."""

    persistent: PersistentSaver
    dirs: CheckpointDirs
    group: BackgroundGroup  # the persistent tier's
    local: LocalTier | None  # None: the local tier is off
    fallback_on_corruption: bool
    pending: quarantine.Pending  # this process's finding to apply (checkpoint.quarantine)


def restore_newest(
    tiers: Tiers, state: dict[str, Any], schedule: SaveSchedule, t0: float
) -> Restore:
    """Fill ``state`` in place from the newest checkpoint of any tier; what was restored.

    COLLECTIVE (``CheckpointManager.load_latest`` calls it on every rank; ``t0`` is when that
    call began). Settles and waits (bounded) for the persistent saves in flight, lists the
    committed persistent steps, asks the local tier for a step at least as new, and loads the
    persistent tier otherwise. A restore from the local tier tells ``schedule`` (a persistent
    step may be owed). First, with every save settled, the quarantines pending (a finding of
    silent data corruption: ``checkpoint.quarantine``) are applied, and no tier restores a
    step they distrust.
    """
    _settle_persistent(tiers.persistent)
    group = tiers.group.current()
    limit = quarantine.settle(tiers.dirs, tiers.local, group, tiers.pending)
    # Nothing in flight any more and every pending quarantine applied: the saves of the run
    # that resumes from here (the rolled-back one) commit again.
    tiers.persistent.refuse_after(None)
    committed = [c for c in list_committed(tiers.dirs, group) if limit is None or c.step <= limit]
    newest = committed[-1].step if committed else None
    if tiers.local is not None:
        # load() settles first: after a restart it cancels the background work in flight
        # instead of waiting on a peer that may be gone.
        try:
            result = tiers.local.load(state, min_step=newest, max_step=limit)
        except ShardingMismatchError as e:  # raised on every rank, before any write
            log.warning(
                "checkpoint: the local tier's shards do not fit the live mesh (%s); "
                "loading the persistent tier, which reshards",
                e,
            )
            result = None
        if result is not None:
            schedule.after_local_restore(int(result.step), newest)
            return Restore(int(result.step), str(result.tier), float(result.seconds))
    with keyed_by_rank(state, current_rank()):
        ckpt = load_latest(
            tiers.dirs,
            state,
            group,
            fallback_on_corruption=tiers.fallback_on_corruption,
            max_step=limit,
        )
    seconds = time.perf_counter() - t0
    if ckpt is None:
        return Restore(None, None, seconds)
    return Restore(ckpt.step, "persistent", seconds)


def _settle_persistent(persistent: PersistentSaver) -> None:
    """Let the persistent saves in flight end (bounded waits), so that a listing sees them."""
    persistent.settle_after_restart()
    # A save abandoned at the restart may be past its commit decision: wait (bounded) until
    # it stopped, so the listing below already shows it if it committed. Otherwise it could
    # commit after the listing, and the next save would reuse its step over a newer commit.
    persistent.drain_abandoned()
    try:
        persistent.wait()
    except CheckpointError as e:
        # Every rank sees the same failure; the previous commit is still the latest, and
        # restoring from it is exactly what the caller asked for.
        log.error("checkpoint: the save in flight failed; loading anyway: %s", str(e))
