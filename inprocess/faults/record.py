"""The record of fired faults: a crash-safe fire-once claim and one fsynced JSON line per fault.

Layout of a record directory (the caller names it: a run directory, a test's tmp dir)::

    fired/<fault name>   claim marker, created with O_EXCL: the fault fires once per directory
    fired.jsonl          one JSON line per fired fault, appended and fsynced before it fires
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from restartable.checkpoint.private_files import open_private, private_dir

RECORD_FILE = "fired.jsonl"
CLAIM_DIR = "fired"


@dataclass(frozen=True)
class FiredFault:
    """One fault as recorded just before it fired.

    ``fault``: the planned fault's name (e.g. ``kill@rank1:step40``); ``rank``: ``ctx.rank``;
    ``initial_rank``: RANK at launch; ``step``: the step it fired at (None: the caller gave
    none); ``time``: ``time.time()`` just before the fault, the start of its detection.
    """

    fault: str
    kind: str
    rank: int
    initial_rank: int
    iteration: int
    step: int | None
    time: float
    pid: int

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def claim(record_dir: str | os.PathLike[str], name: str) -> bool:
    """True exactly once per ``record_dir`` for fault ``name`` (atomic across processes).

    A step that replays after a restart, or a reserve that took the faulty rank's place, gets
    False and carries on. The marker survives any crash of the claiming process.
    """
    # the run directory itself first: whoever may write it could swap the claims directory
    claims = private_dir(record_dir, what="fault record directory") / CLAIM_DIR
    private_dir(claims, what="fault claims directory")
    try:
        fd = open_private(claims / name, os.O_WRONLY, exclusive=True)
    except FileExistsError:
        return False
    os.close(fd)
    return True


def append(record_dir: str | os.PathLike[str], fault: FiredFault) -> None:
    """Append ``fault`` as one line and fsync it, so it survives a SIGKILL right after."""
    path = Path(record_dir) / RECORD_FILE
    private_dir(path.parent, what="fault record directory")
    line = (json.dumps(fault.as_dict()) + "\n").encode()
    # One write() with O_APPEND: lines of concurrent writers never interleave on a local disk.
    fd = open_private(path, os.O_WRONLY | os.O_APPEND, exclusive=False)
    try:
        written = os.write(fd, line)
        assert written == len(line), f"short write to {path}: {written} of {len(line)} bytes"
        os.fsync(fd)
    finally:
        os.close(fd)


def record_once(record_dir: str | os.PathLike[str], fault: FiredFault) -> bool:
    """Claim ``fault.fault`` and append its record: True exactly once per directory.

    The claim comes first, so two processes never both record (or fire) the same fault; a crash
    between the two leaves the fault claimed, unrecorded and unfired, which is consistent.
    """
    if not claim(record_dir, fault.fault):
        return False
    append(record_dir, fault)
    return True


def fired(record_dir: str | os.PathLike[str]) -> list[FiredFault]:
    """Every fault recorded in ``record_dir``, oldest first ([] when none fired).

    A last line without its newline is a write cut short by a crash (never a fired fault: the
    record is complete before the fault fires) and is skipped.
    """
    path = Path(record_dir) / RECORD_FILE
    if not path.exists():
        return []
    lines = path.read_text().split("\n")[:-1]  # the part after the last newline is not a record
    records = [FiredFault(**json.loads(line)) for line in lines if line.strip()]
    return sorted(records, key=lambda f: f.time)
