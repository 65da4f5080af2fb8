"""What happens to a slot whose process died: a respawn, due now or after a backoff, or the
slot's retirement once its ``--max-respawns`` are spent. ``NodeSupervisor`` asks
(``schedule_respawn``) and starts the process when it is due; the decision logs and journals
itself here."""

from __future__ import annotations

import logging
import signal
from dataclasses import dataclass

from restartable.inprocess import journal
from restartable.inprocess.clock import Clock
from restartable.inprocess.protocol import job_keys
from restartable.inprocess.protocol.ranks import respawn_identity
from restartable.inprocess.protocol.store import Store

log = logging.getLogger(__name__)

_MAX_BACKOFF_S = 60.0  # the longest wait before respawning a crash-looping slot


@dataclass
class Slot:
    """One local rank's place on the node, over the round's respawns."""

    respawns: int = 0
    short_deaths: int = 0  # consecutive deaths before it registered
    due: float | None = None  # monotonic time of a scheduled respawn
    retired: str | None = None


@dataclass(frozen=True)
class Death:
    """A process of the slot that died: which, how (``rc``: Popen's), after how long, and
    whether before it joined the job (``at_startup``)."""

    rank: int  # the slot's rank
    identity: int
    pid: int
    rc: int
    lived: float
    at_startup: bool


def schedule_respawn(
    slot: Slot,
    death: Death,
    *,
    max_respawns: int,
    backoff: float,
    world_size: int,
    store: Store,
    clock: Clock,
) -> None:
    """Retire ``slot``, or set when its next process is due (``slot.due``), announcing that
    process in the round's ``store`` first (never raises on a lost store: the supervisor's
    ``poll_action`` says so). Called by ``NodeSupervisor`` once per death it reaps."""
    how = describe_exit(death.rc)
    slot.short_deaths = slot.short_deaths + 1 if death.at_startup else 0
    if slot.respawns >= max_respawns:
        _retire(slot, death, how, max_respawns)
        return
    # Announced before it starts: a restart decision short of ranks meanwhile waits for
    # it instead of shrinking or stopping the job (inprocess.protocol.capacity).
    identity = respawn_identity(death.rank, slot.respawns + 1, world_size=world_size)
    try:
        job_keys.announce_respawn(store, identity)
    except Exception as exc:  # node 0 (the store) is gone: poll_action() says so
        log.debug("store unreachable while announcing identity %d: %r", identity, exc)
    delay = 0.0
    if slot.short_deaths:  # it never got going: wait, longer each time in a row
        delay = min(_MAX_BACKOFF_S, backoff * 2 ** (slot.short_deaths - 1))
    slot.due = clock.monotonic() + delay
    log.warning(
        "respawn: rank %d (identity %d) %s after %.1f s; a new process for its slot starts "
        "%s (respawn %d/%d of this slot)",
        death.rank,
        death.identity,
        how,
        death.lived,
        "now" if delay == 0 else f"in {delay:.1f} s (backoff: it died at start-up)",
        slot.respawns + 1,
        max_respawns,
    )
    journal.record(
        "respawn",
        slot_rank=death.rank,
        identity=death.identity,
        how=how,
        delay_s=delay,
        proc_pid=death.pid,
        lived_s=death.lived,
    )


def _retire(slot: Slot, death: Death, how: str, max_respawns: int) -> None:
    slot.retired = how
    log.warning(
        "respawn: slot of rank %d retired: its process (identity %d) %s after %.1f s and "
        "the slot was respawned %d time(s) already (--max-respawns %d); the job goes on "
        "without it%s",
        death.rank,
        death.identity,
        how,
        death.lived,
        slot.respawns,
        max_respawns,
        "" if max_respawns else " (respawn is off: --max-respawns 0)",
    )
    journal.record(
        "slot_retired",
        slot_rank=death.rank,
        identity=death.identity,
        how=how,
        proc_pid=death.pid,
        lived_s=death.lived,
    )


def describe_exit(rc: int) -> str:
    """How a process ended, in words, for ``rc`` as Popen gives it (negative: a signal)."""
    if rc < 0:
        try:
            return f"was killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"was killed by signal {-rc}"
    return f"exited with status {rc}"
