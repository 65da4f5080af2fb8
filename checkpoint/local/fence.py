"""Fences in the node-local directory: the steps a finding of silent data corruption distrusts,
for the files no process could move away.

``LocalTier.quarantine_after`` moves this process's files of the distrusted steps and those of
processes that are gone into ``<local_dir>/quarantine/<id>/``. A file whose writer is still
alive (a retired rank still on its way out holds its lock) cannot be moved: its record stays
readable, and a process that scans the directory later (a fresh reserve, whose memory is
empty) would find it. So the quarantine also leaves ``<local_dir>/quarantine/<id>/fence.json``
(``{"after": step}``), and ``directory.scan`` skips every file holding a step after a fence's
step that was last written before the fence (file modification times, both from the node's
file system: the same clock). The rolled-back run's saves of the same step numbers are written
after the fence and are read as usual; one written within the file system's timestamp
granularity of the fence is skipped too (safe: a restore then takes an older step).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from restartable.checkpoint.private_files import private_dir, replace_private

FENCE = "fence.json"
Fence = tuple[int, int]  # (the last trusted step, the fence's modification time in ns)


def write(dest: Path, after: int) -> None:
    """Leave the fence of ``after`` in ``dest`` (a quarantine directory, created private).
    Co-located ranks each write it (atomic replace): its time is the last of theirs, and no
    rank saves before every rank's load (which writes it) returned."""
    private_dir(dest, what="local_dir quarantine directory")
    replace_private(dest / FENCE, json.dumps({"after": int(after)}).encode())


def read(root: Path) -> list[Fence]:
    """Every fence under ``root/quarantine/``; none when there is no such directory."""
    fences: list[Fence] = []
    try:
        entries = list(os.scandir(root / "quarantine"))
    except OSError:
        return fences
    for entry in entries:
        path = Path(entry.path) / FENCE
        try:
            after = int(json.loads(path.read_bytes())["after"])
            fences.append((after, os.stat(path, follow_symlinks=False).st_mtime_ns))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return fences


def distrusted(fences: list[Fence], step: int, written_ns: int) -> bool:
    """Whether a shard of ``step`` last written at ``written_ns`` is behind a fence."""
    return any(step > after and written_ns <= at for after, at in fences)
