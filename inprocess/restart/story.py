"""One console line per restart, for any script: cause, ranks, resumed step and tier, seconds.

    restart 1: dead on rank 0; ranks 0,1 -> 2,1 (reserve: -); resumed step 30: memory on 1
    rank, node-local on 1 rank (the reserve) 0.21 s after the fault

Written by the new rank 0 of each iteration after a restart, once ``train()`` restored its state
(a ``CheckpointManager`` restore, seen on the journal channel) and the other active ranks said
which tier theirs came from (``inprocess.restart.restored``, bounded) or, without one, at its
first ``ctx.ping(step)`` (or when the iteration ends, for a script that reports no step). Through
the logger ``inprocess.restart.story`` at INFO; when the script configured no logging at all
(no handler anywhere), on stderr instead, the way Python's last-resort handler shows warnings:
a restart is lifecycle a user must see without setting anything up.
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any

from restartable.inprocess import journal
from restartable.inprocess.clock import SYSTEM, Clock
from restartable.inprocess.context import RestartRecord
from restartable.inprocess.restart.restored import TierBoard, phrase, tier_name

log = logging.getLogger(__name__)


class RestartStory(logging.Handler):
    """The pending restart line of this rank (owned by the restart loop; main thread).

    ``restarted`` (on every active rank after a restart) starts listening for the restore;
    ``lead`` (the new rank 0) writes the line, the others only publish their tier on
    ``board``. ``end_iteration`` writes a line still pending; ``close`` stops listening and
    waits (bounded) for a line being written. The journal channel is listened to only while a
    line is pending, so steps pay nothing.
    """

    def __init__(self, *, clock: Clock = SYSTEM) -> None:
        super().__init__(level=logging.DEBUG)
        self._clock = clock
        self._pending: tuple[RestartRecord, float] | None = None
        self._thread = threading.get_ident()
        self._lead = True
        self._board: TierBoard | None = None
        self._writer: threading.Thread | None = None

    def restarted(
        self,
        record: RestartRecord,
        *,
        fault_time: float,
        lead: bool = True,
        board: TierBoard | None = None,
    ) -> None:
        """The restart that led to this iteration; ``fault_time``: the wall clock of its
        first fault."""
        self.end_iteration()
        self._pending = (record, fault_time)
        self._thread = threading.get_ident()
        self._lead, self._board = lead, board
        journal.listen(self)

    def emit(self, rec: logging.LogRecord) -> None:
        # Only this thread's train(): background saves log on the channel too.
        if self._pending is None or rec.thread != self._thread:
            return
        fields: dict[str, Any] = getattr(rec, "journal", {})
        if rec.msg == "restore":
            restore = (fields.get("step"), fields.get("tier"))
            if self._board is not None:
                self._board.publish(restore[1], restore[0])
            self._say(restore, board=self._board)
        elif rec.msg == "step":  # a first step before any restore: train() restores nothing
            self._say(None, first_step=fields.get("step"))

    def end_iteration(self) -> None:
        """The iteration ended (train() returned or raised): a line still pending is written."""
        if self._pending is not None:
            self._say(None)

    def close(self) -> None:
        journal.unlisten(self)
        self._pending = None
        if self._writer is not None:
            self._writer.join(timeout=10.0)
        super().close()

    def _say(
        self,
        restore: tuple[int | None, str | None] | None,
        *,
        first_step: int | None = None,
        board: TierBoard | None = None,
    ) -> None:
        assert self._pending is not None
        record, fault_time = self._pending
        self._pending = None
        journal.unlisten(self)
        if not self._lead:
            return
        seconds = self._clock.wall() - fault_time
        if board is None or restore is None:
            say(line(record, restore=restore, seconds=seconds, first_step=first_step))
            return
        newcomers = set(record.active_after) - set(record.active_before)

        def write() -> None:  # off the training thread: the other ranks' tiers may lag
            tiers = phrase(board.gather(), newcomers)
            say(line(record, restore=restore, seconds=seconds, tiers=tiers))

        self._writer = threading.Thread(target=write, name="inprocess-restart-line", daemon=True)
        self._writer.start()


def line(
    record: RestartRecord,
    *,
    restore: tuple[int | None, str | None] | None,
    seconds: float,
    first_step: int | None = None,
    tiers: str = "",
) -> str:
    """The restart's line (pure). ``restore``: (step, tier) of the CheckpointManager restore,
    (None, None) when it found nothing, None when train() restored nothing through one;
    ``first_step``: then, the step of the iteration's first ``ctx.ping``, if it reported one;
    ``tiers``: each rank's tier (``restored.phrase``), else rank 0's alone is said."""

    def ranks(rs: tuple[int, ...]) -> str:
        return ",".join(map(str, rs)) or "-"

    if restore is None and first_step is not None:
        resumed = f"no CheckpointManager restore; first step {first_step}"
    elif restore is None:
        resumed = "no CheckpointManager restore;"
    elif restore[0] is None:
        resumed = "no checkpoint to resume from (started over);"
    elif tiers:
        resumed = f"resumed step {restore[0]}: {tiers}"
    else:
        resumed = f"resumed step {restore[0]} from the {tier_name(restore[1])} tier"
    return (
        f"restart {record.iteration}: {record.cause}; ranks {ranks(record.active_before)} -> "
        f"{ranks(record.active_after)} (reserve: {ranks(record.reserve_after)}); {resumed} "
        f"{seconds:.2f} s after the fault"
    )


def say(text: str) -> None:
    """INFO on ``inprocess.restart.story``; on stderr when no logging is configured anywhere."""
    if log.hasHandlers():
        log.info("%s", text)
    else:
        print(text, file=sys.stderr, flush=True)
