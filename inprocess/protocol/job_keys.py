"""The job-level keys the launcher and the ranks share: a respawned process joining the reserve
pool, the current iteration, and how the in-process path ended (done or stopped).

Keys (under ``restartable/``, next to ``inprocess.protocol.keys``'s): ``iteration`` (the
iteration the ranks are in), ``joiners`` (respawned identities that are ready to wait as
reserves, appended),
``respawning`` (identities a launcher is starting: capacity on its way, appended),
``stopped`` (why the in-process path gave up; first writer wins). The launcher
(``inprocess.launch.supervisor``) reads them to choose between a respawn and an in-job restart.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from restartable.checkpoint.sealing import ForgedValueError, parse_count
from restartable.inprocess.clock import SYSTEM, Clock
from restartable.inprocess.errors import RestartAbortedError, StoreTimeoutError
from restartable.inprocess.protocol import iteration_end, keys
from restartable.inprocess.protocol.policy import Decision
from restartable.inprocess.protocol.ranks import Assignment
from restartable.inprocess.protocol.store import Store

log = logging.getLogger(__name__)
# The run journal's channel (``inprocess.journal`` writes what reaches it): the protocol sits
# below the journal and does not import it.
_journal = logging.getLogger("restartable.journal")

ITERATION_KEY = keys.ROOT + "iteration"
JOINERS_KEY = keys.ROOT + "joiners"
RESPAWNING_KEY = keys.ROOT + "respawning"
STOPPED_KEY = keys.ROOT + "stopped"
STOPPED_ORIGIN_KEY = keys.ROOT + "stopped_origin"
JOURNAL_DIR_KEY = keys.ROOT + "journal_dir"  # where the ranks journal: the launcher joins them
INIT_DONE_KEY = keys.ROOT + "init/go"  # released by the initial barrier: the job is restartable
# The iteration a respawned process's watchdog reports for until it is admitted: no rank ever
# reaches it, so a report there only marks the process gone (``store.GONE_KEY``).
PARKED_ITERATION = 2**31 - 1

JOB_NOT_STARTED = "not_started"  # no rank passed the initial barrier (yet): not a @restartable job
JOB_RUNNING = "running"
JOB_DONE = "done"
JOB_STOPPED = "stopped"


@dataclass(frozen=True)
class Admission:
    """A respawned process's place in the job: it takes part from ``iteration`` on, with the
    roles of ``assignment``; ``decisions`` are every earlier restart decision, oldest first (the
    history every rank keeps, so this one decides like the others)."""

    iteration: int
    assignment: Assignment
    decisions: tuple[Decision, ...]


def start_iteration(
    store: Store,
    iteration: int,
    *,
    participants: int,
    reserves: Sequence[int],
    by_node: bool = False,
) -> None:
    """Every rank, at the start of each iteration, in one write (one transaction on etcd):
    the iteration a newcomer starts looking at, how many ranks take part in it (the restart
    barrier's count; ``by_node``: marked as met by node, ``keys.participants_item``) and its
    warm reserves (``inprocess.restart.demotion``)."""
    keys.set_many(
        store,
        dict(
            [
                (ITERATION_KEY, str(iteration)),
                keys.participants_item(iteration, participants, by_node=by_node),
                keys.reserves_item(iteration, reserves),
            ]
        ),
    )


def current_iteration(store: Store) -> int:
    """The iteration the ranks last announced (0 before the first); never blocks. Raises
    ``ForgedValueError`` naming the key when its value fails to verify or is not a number."""
    raw = keys.peek(store, ITERATION_KEY)
    return 0 if raw is None else parse_count(ITERATION_KEY, raw)


def register_joiner(store: Store, identity: int) -> None:
    """A respawned process is connected and ready: the next restart decision may admit it.

    Journals ``reserve_ready`` (the end of a respawn's recovery in the downtime report)."""
    store.append(JOINERS_KEY, f"{identity},")
    if _journal.handlers:  # a journal is open (or listened to) in this process
        _journal.debug("reserve_ready", extra={"journal": {"identity": identity}})


class OpenJournal(Protocol):
    """What ``publish_journal_dir`` reads of an open journal (``inprocess.journal.Journal``)."""

    path: Path


def publish_journal_dir(store: Store, jr: OpenJournal | None) -> None:
    """Every rank after connecting: the directory of its open journal (``inprocess.journal
    .Journal`` or None), so that a launcher started without ``RESTARTABLE_JOURNAL_DIR`` writes
    its records (respawns, in-job restarts) beside the ranks'. First writer wins; never blocks."""
    if jr is not None:
        store.compare_set(JOURNAL_DIR_KEY, "", str(jr.path.parent.resolve()))


def journal_dir(store: Store) -> str | None:
    """The ranks' journal directory (``publish_journal_dir``), or None; never blocks."""
    return store.get(JOURNAL_DIR_KEY).decode() if store.check([JOURNAL_DIR_KEY]) else None


def registered_joiners(store: Store) -> set[int]:
    """Every respawned identity that ever registered (alive or not); never blocks."""
    return keys.parse_ranks(keys.peek(store, JOINERS_KEY))


def gone_and_ready_joiners(store: Store) -> tuple[set[int], set[int]]:
    """The ranks known gone (``keys.gone_ranks``) and the registered respawned identities not
    among them, read together (one transaction on etcd); never blocks."""
    gone_raw, joiners_raw = keys.peek_many(store, [keys.GONE_KEY, JOINERS_KEY])
    gone = keys.parse_ranks(gone_raw)
    return gone, keys.parse_ranks(joiners_raw) - gone


def ready_joiners(store: Store) -> set[int]:
    """Registered respawned identities whose process is not known to be gone; never blocks."""
    return gone_and_ready_joiners(store)[1]


def announce_respawn(store: Store, identity: int) -> None:
    """The launcher decided to start ``identity`` (``ranks.respawn_identity``) in a dead
    process's slot: a restart decision short of ranks may wait for it (``pending_respawns``).

    Called before the process starts, so that a decision taken while it starts knows of it.
    It stops being pending when it registers (``register_joiner``) or is marked gone."""
    store.append(RESPAWNING_KEY, f"{identity},")


def respawn_state(store: Store) -> tuple[set[int], set[int], set[int]]:
    """``(gone, ready, pending)`` read together (one transaction on etcd); never blocks.

    ``gone``: ranks known gone; ``ready``: registered respawned identities not gone;
    ``pending``: announced respawns (``announce_respawn``) neither registered nor gone."""
    gone_raw, joiners_raw, pending_raw = keys.peek_many(
        store, [keys.GONE_KEY, JOINERS_KEY, RESPAWNING_KEY]
    )
    gone, joiners = keys.parse_ranks(gone_raw), keys.parse_ranks(joiners_raw)
    return gone, joiners - gone, keys.parse_ranks(pending_raw) - joiners - gone


def mark_gone(store: Store, identity: int) -> None:
    """The launcher saw ``identity``'s process exit: no barrier or decision waits for it.

    Unlike a watchdog's report this ends no iteration: a respawned process that dies before it
    is admitted (a crash loop) must not interrupt the ranks that train.
    """
    store.append(keys.GONE_KEY, f"{identity},")


def mark_stopped(store: Store, reason: str, *, origin: str = "") -> None:
    """The in-process path gave up (``RestartAbortedError``, a barrier timeout): the launcher
    restarts the job in place, unless ``origin`` is "application" (a bug: it ends the job
    without a requeue). First writer wins; never blocks. The origin is set before the reason,
    so a launcher that sees the reason sees its origin too."""
    if origin:
        store.compare_set(STOPPED_ORIGIN_KEY, "", origin)
    store.compare_set(STOPPED_KEY, "", reason[:2000])


def stop_origin(store: Store) -> str:
    """The origin ``mark_stopped`` was given ("application" or ""); never blocks. One that
    fails to verify (logged, naming the key) is "": the job restarts or is requeued, the
    safe side (an "application" stop ends it for good)."""
    try:
        raw = keys.peek(store, STOPPED_ORIGIN_KEY)
    except ForgedValueError:
        return ""
    return "" if raw is None else raw.decode()


def job_state(store: Store) -> str:
    """``JOB_NOT_STARTED``, ``JOB_RUNNING``, ``JOB_DONE`` or ``JOB_STOPPED``; never blocks."""
    if store.check([STOPPED_KEY]):
        return JOB_STOPPED
    if not store.check([INIT_DONE_KEY]):
        return JOB_NOT_STARTED
    return (
        JOB_DONE
        if iteration_end.outcome(store, current_iteration(store)) == keys.OUTCOME_DONE
        else (JOB_RUNNING)
    )


def stop_reason(store: Store) -> str | None:
    """Why the in-process path stopped, or None."""
    return store.get(STOPPED_KEY).decode() if store.check([STOPPED_KEY]) else None


def wait_admission(
    store: Store,
    *,
    identity: int,
    decision_timeout: float,
    since: int,
    clock: Clock = SYSTEM,
) -> Admission | None:
    """Called once by a respawned process after ``register_joiner``: wait until a restart
    decision puts ``identity`` in the reserve pool (or the active set).

    ``since``: ``current_iteration`` read BEFORE registering (read later, it can be past an
    admission decided between the registration and this call). The decisions from that
    iteration on are read in turn. Returns None when the job finishes first. Blocks while the
    ranks train (the next restart admits it); each decision is awaited at most
    ``decision_timeout`` seconds once its iteration faulted (``StoreTimeoutError``). Raises
    ``RestartAbortedError`` when the job stops.
    """
    it = since
    while True:
        if iteration_end.wait_outcome(store, it, timeout=None, clock=clock) == keys.OUTCOME_DONE:
            return None
        decision = Decision.from_json(_wait_get(store, _go_key(it), decision_timeout, clock))
        if decision.stop is not None or decision.assignment is None:
            raise RestartAbortedError(decision.stop or "no assignment")
        a = decision.assignment
        if identity in a.active or identity in a.reserve:
            earlier = tuple(
                Decision.from_json(store.get(_go_key(k)).decode()) for k in range(it + 1)
            )
            return Admission(iteration=it + 1, assignment=a, decisions=earlier)
        it += 1  # registered after this decision was taken: the next one admits it


def _go_key(iteration: int) -> str:
    return keys.iteration_prefix(iteration) + "restart/go"


def _wait_get(store: Store, key: str, timeout: float, clock: Clock) -> str:
    deadline = clock.monotonic() + timeout
    while not store.check([key]):
        left = deadline - clock.monotonic()
        if left <= 0:
            raise StoreTimeoutError(f"{key} was not published within {timeout} s")
        try:
            store.wait([key], datetime.timedelta(seconds=min(left, 1.0)))
        except Exception as exc:
            if "timeout" not in str(exc).lower() and not isinstance(exc, TimeoutError):
                raise
    return store.get(key).decode()
