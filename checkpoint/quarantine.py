"""Checkpoints a finding of silent data corruption distrusts, made unrestorable on every tier.

``CheckpointManager.quarantine_after(step, finding=...)`` (every rank, when the finding is
settled, before the restart) says: every step after ``step`` was trained on corrupt arithmetic
or is not verified, the job rolls back to ``step``. From then on no persistent save of a later
step commits (``PersistentSaver.refuse_after``), and rank 0 writes the durable record
(``checkpoint.persistent.quarantine``). The next ``load_latest`` (COLLECTIVE: this run's restart,
a requeued job, the user's own resume), once the saves in flight settled, calls ``settle``: the
persistent checkpoints after the step move to ``<root>/quarantine/<id>/``, the local tier forgets
its memory copies and moves its node-local files to ``<local_dir>/quarantine/<id>/``, and that
load restores nothing newer. Each copy is logged (WARNING: step, tier, path, finding) and
journaled (``checkpoint_quarantined``). docs/checkpoint.md ("Quarantined checkpoints").
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from restartable.checkpoint.collectives import all_gather, rank_and_size
from restartable.checkpoint.errors import CheckpointConfigError
from restartable.checkpoint.per_rank import current_rank
from restartable.checkpoint.persistent import quarantine as persistent_q

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from restartable.checkpoint.local import LocalTier
    from restartable.checkpoint.persistent import CheckpointDirs, PersistentSaver

log = logging.getLogger("restartable.checkpoint.manager")
# The run journal's channel (see inprocess/journal.py; a name: checkpoint does not import it).
_journal = logging.getLogger("restartable.journal")


@dataclass
class Pending:
    """This process's own finding not yet applied: the trusted step and the finding."""

    after: int | None = None
    finding: dict[str, Any] = field(default_factory=dict)

    def add(self, step: int, finding: dict[str, Any]) -> None:
        if self.after is None or step < self.after:
            self.after, self.finding = step, dict(finding)


def request(
    mine: Pending,
    persistent: PersistentSaver,
    dirs: CheckpointDirs,
    step: int,
    finding: Mapping[str, Any] | None,
) -> None:
    """``CheckpointManager.quarantine_after`` (rank-local, at the finding): remember the
    step, refuse later persistent commits, and on rank 0 write the durable record."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointConfigError(
            f"step ({step!r}) must be an integer >= 0: the last trusted step"
        )
    fields = dict(finding or {})
    mine.add(step, fields)
    persistent.refuse_after(mine.after)
    if current_rank() == 0:
        _record(dirs, step, fields)


def _record(dirs: CheckpointDirs, step: int, finding: dict[str, Any]) -> None:
    """Rank 0 writes the durable record; a failure is logged, and the next load still applies
    this process's own pending step."""
    try:
        where = persistent_q.write_record(dirs, step, finding)
    except Exception as e:
        log.error(
            "checkpoint: could not record the quarantine of the steps after %d under %s (%s): "
            "a job that resumes from this root before this one reloads may restore them",
            step,
            dirs.url,
            e,
        )
        return
    log.warning(
        "checkpoint: every step after %d is distrusted (%s): quarantined at the next load, "
        "recorded in %s",
        step,
        _what(finding),
        where,
    )


def settle(
    dirs: CheckpointDirs,
    local: LocalTier | None,
    group: ProcessGroup | None,
    mine: Pending,
) -> int | None:
    """COLLECTIVE, inside ``load_latest`` after the persistent saves in flight settled: apply
    every pending quarantine (this process's, its peers', and the durable records under the
    root). Returns the newest step the load may restore (None: no limit). One all-gather of
    small objects; rank 0 also lists ``<root>/quarantine/``."""
    rank, _ = rank_and_size(group)
    records: list[tuple[str, dict[str, Any]]] = []
    if rank == 0:
        try:
            records = persistent_q.pending(dirs)
        except OSError as e:
            log.error("checkpoint: listing %s failed: %s", dirs.join("quarantine"), e)
    every = all_gather((mine.after, mine.finding, records if rank == 0 else None), group)
    ranks_own = [(a, f) for a, f, _ in every if a is not None]
    held = every[0][2] or []
    steps = [a for a, _ in ranks_own] + [int(b["after"]) for _, b in held]
    if not steps:
        return None
    limit = min(steps)
    finding = next((f for a, f in ranks_own if a == limit and f), None)
    finding = finding or next((b.get("finding", {}) for _, b in held), {})
    name = os.path.basename(held[0][0].rstrip("/")) if held else f"sdc-after{limit}-unrecorded"
    if rank == 0:
        _quarantine_persistent(dirs, held, limit, name, finding)
    if local is not None:
        for tier, step, where in local.quarantine_after(limit, name):
            _tell(tier, step, where, finding)
    mine.after, mine.finding = None, {}
    return limit


def _quarantine_persistent(
    dirs: CheckpointDirs,
    records: list[tuple[str, dict[str, Any]]],
    limit: int,
    name: str,
    finding: dict[str, Any],
) -> None:
    try:
        moved = persistent_q.apply_records(dirs, records, limit, name)
    except OSError as e:
        log.error(
            "checkpoint: moving the persistent checkpoints after step %d into %s failed (%s): "
            "this load skips them; the next load tries again",
            limit,
            dirs.join("quarantine", name),
            e,
        )
        return
    for m in moved:
        _tell("persistent", m.step, m.path, finding, source=m.source)


def _tell(
    tier: str, step: int, where: str, finding: dict[str, Any], *, source: str | None = None
) -> None:
    was = f" (was {source})" if source else ""
    log.warning(
        "checkpoint: quarantined step %d of the %s tier: %s%s; never restored: %s",
        step,
        tier,
        where,
        was,
        _what(finding),
    )
    if _journal.handlers:
        fields = {"step": step, "tier": tier, "path": where, "finding": _brief(finding)}
        _journal.debug("checkpoint_quarantined", extra={"journal": fields})


def _what(finding: dict[str, Any]) -> str:
    """The finding in words, from whichever of its fields the caller gave."""
    if "rank" in finding and "step" in finding:
        text = f"silent data corruption on rank {finding['rank']} at step {finding['step']}"
    else:
        text = "a finding of silent data corruption"
    if "detected_at" in finding:
        text += f", found at step {finding['detected_at']}"
    if "verdict" in finding:
        text += f" ({finding['verdict']})"
    if "rollback_to" in finding:
        text += f", rolled back to step {finding['rollback_to']}"
    return text


def _brief(finding: dict[str, Any]) -> dict[str, Any]:
    keys = ("rank", "host", "step", "verdict", "detected_at", "rollback_to")
    return {k: finding[k] for k in keys if k in finding}
