"""The job's end status, recorded once per launch in a file next to the ``--autoresume-file``
flag (shared storage, read without any store): whichever launcher ends first records it, every
other launcher and a killed launcher's ``inprocess.srun_task`` stand-in read it, so no ending
depends on a race with node 0's store going away.

    <flag>.end-<launch id>     {"launch": ..., "status": s, "reason": "..."}  (0600, JSON)

First writer wins (the file is linked into place, never replaced), so every node exits with the
same status and settles the flag the same way (a 0 on one node never removes the flag that a 75
on another wrote, the job ending FAILED 75:0 "no retry left" on attempt 0). The first writer
removes the records of earlier launches (a requeued Slurm attempt is a new launch id).

Stdlib only: the stand-in reads it before it imports torch.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from restartable.checkpoint.private_files import replace_private

_SUFFIX = ".end-"


class JobOutcome:
    """The end record of launch ``launch_id`` for the flag ``flag_path`` (None: no flag file,
    so no record: ``read`` gives None and ``record`` keeps the status it is given)."""

    def __init__(self, flag_path: str | None, launch_id: str | None) -> None:
        self.flag_path, self.launch_id = flag_path, launch_id

    @property
    def path(self) -> Path | None:
        """The record's file (None without a flag file or a launch id)."""
        if self.flag_path is None or not self.launch_id:
            return None
        flag = Path(self.flag_path)
        return flag.with_name(f"{flag.name}{_SUFFIX}{self.launch_id}")

    def read(self) -> tuple[int, str] | None:
        """The recorded (status, reason), or None while no launcher ended (never raises)."""
        path = self.path
        if path is None:
            return None
        try:
            d = json.loads(path.read_text())
            if d.get("launch") != self.launch_id:
                return None
            return int(d["status"]), str(d["reason"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def record(self, status: int, reason: str) -> tuple[int, str]:
        """Record (status, reason) unless a launcher of this launch did first; the record that
        won. Never raises: a record that cannot be written leaves this node's own status."""
        path = self.path
        if path is None:
            return status, reason
        data = json.dumps({"launch": self.launch_id, "status": status, "reason": reason})
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            replace_private(tmp, data.encode() + b"\n")
            try:
                os.link(tmp, path)  # atomic, and fails where another node won
            except FileExistsError:
                pass
            else:
                _forget_earlier(path)
        except OSError:
            return status, reason
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()
        won = self.read()
        return won if won is not None else (status, reason)


def _forget_earlier(path: Path) -> None:
    """Remove the records of other launches of the same flag (earlier attempts)."""
    prefix = path.name.split(_SUFFIX)[0] + _SUFFIX
    for old in path.parent.glob(f"{prefix}*"):
        if old.name != path.name:
            with contextlib.suppress(OSError):
                old.unlink()
