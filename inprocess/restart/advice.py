"""A warning at start for a job whose killed ranks would lose their checkpointed state.

A job that replaces killed ranks (a warm reserve, or ``inprocess.launch --max-respawns``) but
keeps its local checkpoint tier in each process's memory only (no ``local_dir``, no replica on
another node) loses a killed rank's copy with the process: every rank then restarts from the
newest persistent checkpoint, or from step 0 before the first one ("no checkpoint to resume
from (started over)"), the configuration of ``examples/minimal.py``. The CheckpointManager says
what its tiers are in one journal-channel record (``tiers``, at its first save:
``checkpoint.config.tiers_record``); the restart loop of the first active rank 0 listens for it
during its first iteration only, for at most ``_MAX_RECORDS`` records (steps pay nothing
after).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from restartable.inprocess import journal

log = logging.getLogger(__name__)

# Journal records (a step's is one) heard before giving up on the manager's first save: each
# costs a LogRecord while listening.
_MAX_RECORDS = 1000


class KillAdvice(logging.Handler):
    """Listens for the manager's ``tiers`` record; warns once when a kill would lose state.

    Owned by the restart loop (main thread): ``start`` listens, ``stop`` stops
    (idempotent: at the end of the first iteration, or once the record was seen).
    """

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self._replaces = ""
        self._thread = threading.get_ident()
        self._listening = False
        self._heard = 0

    def start(self, *, reserves: int, max_respawns: int) -> None:
        """Listen on this thread's journal channel when this job replaces killed ranks
        (``reserves`` waiting, or the launcher's ``max_respawns`` > 0); else do nothing."""
        if reserves <= 0 and max_respawns <= 0:
            return
        self._replaces = (
            f"{reserves} warm reserve{'s' if reserves > 1 else ''}"
            if reserves > 0
            else f"--max-respawns {max_respawns}"
        )
        self._thread = threading.get_ident()
        self._listening = True
        journal.listen(self)

    def stop(self) -> None:
        if self._listening:
            self._listening = False
            journal.unlisten(self)

    def emit(self, rec: logging.LogRecord) -> None:
        self._heard += 1
        if self._heard > _MAX_RECORDS:  # no save yet: steps stop paying for the listener
            self.stop()
            return
        if rec.msg != "tiers" or rec.thread != self._thread:
            return
        self.stop()
        fields: dict[str, Any] = getattr(rec, "journal", {})
        text = advice(fields, replaces=self._replaces)
        if text is not None:
            log.warning("%s", text)


def advice(tiers: dict[str, Any], *, replaces: str) -> str | None:
    """The warning for a manager's ``tiers`` record (pure); None when a killed rank's copy
    survives it (a node-local directory or a replica), or when there is no local tier (the
    persistent interval is then the user's evident choice)."""
    if not tiers.get("local") or tiers.get("local_dir") or tiers.get("replication_factor", 1) > 1:
        return None
    every = tiers.get("persistent_every")
    return (
        f"checkpoint: this job replaces a killed rank ({replaces}), but the local tier keeps "
        "each rank's copy in its process's memory only (local_dir=None, replication_factor=1): "
        "a killed rank's copy dies with it, and every rank then resumes from the newest "
        f"persistent checkpoint (persistent_every={every}), or starts over before the first "
        "one. Fix: give CheckpointManager a node-local directory, e.g. "
        "local_dir='/dev/shm/<job>/ckpt' (it survives the process), or replication_factor=2 "
        "on several nodes"
    )
