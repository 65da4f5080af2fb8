"""Quarantine of persistent checkpoints a finding distrusts (silent data corruption).

Layout under the checkpoint root::

    <root>/quarantine/<id>/finding.json          the record: why, which steps, applied or not
    <root>/quarantine/<id>/step_<10 digits>-<8 hex>/   a quarantined checkpoint, moved whole

``<id>`` is ``sdc-step<S>-found<D>-<8 hex>`` (the finding's corrupt step, the step it was found
at, a fresh token): two findings never share a directory, and a step number the rolled-back run
trains again (its own ``step_...-<token>`` directory in the root) never collides with the
quarantined one. The listing (``CheckpointDirs.list_committed``) reads only the root's own
``step_...`` entries, so nothing under ``quarantine/`` is ever restored; retention never deletes
it either (evidence: the user inspects it, loads it on purpose by passing
``<root>/quarantine/<id>`` as a manager's root, and deletes it with ``rm -r``).

Two phases, so that neither a crash nor a save in flight can leave a distrusted step visible:
``write_record`` (rank 0, when the finding is settled, before the restart) makes the intent
durable; ``apply_records`` (rank 0, inside the next ``load_latest``, once the saves in flight
have settled) moves every committed step newer than the record's trusted step and marks the
record applied. Between the two no step of the rolled-back run is saved (the restart's load
comes first), so at ``apply_records`` every committed step newer than the trusted one is the
distrusted run's, whoever calls it: this run's restart, a requeued job, the user's own resume.
Local paths only move by ``os.replace`` (atomic); other filesystems copy, then delete the
original commit marker first (``CheckpointDirs.remove``).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from dataclasses import dataclass
from typing import Any

from restartable.checkpoint.persistent.layout import CheckpointDirs, fsync_dir
from restartable.checkpoint.private_files import private_dir

log = logging.getLogger(__name__)

QUARANTINE_DIR = "quarantine"
RECORD = "finding.json"


@dataclass(frozen=True)
class Moved:
    """One quarantined checkpoint: its step, where it was, where it is now."""

    step: int
    source: str
    path: str


def record_id(finding: dict[str, Any]) -> str:
    """A fresh quarantine directory name for ``finding`` (its ``step`` and ``detected_at``)."""
    step, found = int(finding.get("step", -1)), int(finding.get("detected_at", -1))
    return f"sdc-step{step}-found{found}-{secrets.token_hex(4)}"


def write_record(dirs: CheckpointDirs, trusted: int, finding: dict[str, Any]) -> str:
    """Rank 0, when a finding is settled: durably record that every committed step after
    ``trusted`` is to be quarantined; the record's directory. Rank-local; never blocks on
    peers (one small file write)."""
    qid = record_id(finding)
    where = dirs.join(QUARANTINE_DIR, qid)
    _makedirs(dirs, where)
    body = {"after": int(trusted), "applied": False, "finding": finding, "moved": []}
    dirs.write_small(dirs.join_dir(where, RECORD), body)
    return where


def pending(dirs: CheckpointDirs) -> list[tuple[str, dict[str, Any]]]:
    """Rank 0: the records not yet applied, as (record directory, body), oldest id first."""
    top = dirs.join(QUARANTINE_DIR)
    try:
        entries = sorted(str(e).rstrip("/") for e in dirs.fs.ls(top, detail=False))
    except FileNotFoundError:
        return []
    out = []
    for where in entries:
        try:
            body = json.loads(dirs.fs.cat_file(dirs.join_dir(where, RECORD)))
        except (FileNotFoundError, NotADirectoryError, ValueError, OSError):
            continue  # a directory of the user's own, or a torn record: not ours to act on
        if isinstance(body, dict) and body.get("applied") is False and "after" in body:
            out.append((where, body))
    return out


def apply_records(
    dirs: CheckpointDirs, records: list[tuple[str, dict[str, Any]]], limit: int, name: str
) -> list[Moved]:
    """Rank 0, inside ``load_latest`` after the saves in flight settled: move every committed
    step newer than ``limit`` (the oldest trusted step) into ``quarantine/<name>/`` (the first
    record's directory, made when there is no record), then mark every record applied. Returns
    what moved. A failed move raises (OSError) and leaves the records pending: the next load
    tries again, and this one restores nothing newer than ``limit`` anyway."""
    where, body = records[0] if records else (dirs.join(QUARANTINE_DIR, name), None)
    if body is None:  # the record could not be written at the finding: make it now
        body = {"after": limit, "applied": False, "finding": {}, "moved": []}
        _makedirs(dirs, where)
    moved = [_move(dirs, c.step, c.path, where) for c in dirs.list_committed() if c.step > limit]
    prior = [str(p) for p in body.get("moved", [])]
    dirs.write_small(
        dirs.join_dir(where, RECORD),
        {**body, "applied": True, "moved": prior + [m.path for m in moved]},
    )
    for other, other_body in records[1:]:
        dirs.write_small(dirs.join_dir(other, RECORD), {**other_body, "applied": True})
    return moved


def _move(dirs: CheckpointDirs, step: int, source: str, where: str) -> Moved:
    name = source.rstrip("/").rsplit("/", 1)[-1]
    dest = dirs.join_dir(where, name)
    if dirs.is_local:
        os.replace(source, dest)
        fsync_dir(os.path.dirname(source))
        fsync_dir(where)
    else:
        dirs.fs.copy(source, dest, recursive=True)
        dirs.remove(source)  # commit marker first: never a torn visible checkpoint
    return Moved(step, source, dest)


def _makedirs(dirs: CheckpointDirs, where: str) -> None:
    if dirs.is_local:
        private_dir(where, what="checkpoint quarantine directory")
    else:
        dirs.fs.makedirs(where, exist_ok=True)
