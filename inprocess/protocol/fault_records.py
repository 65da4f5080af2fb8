"""Fault records: how any process reports a fault of a rank, and how the decider reads them.

A fault is appended to its iteration's ``faults`` list (``keys``) and ends the iteration at
once: the same writes break its ``join`` and ``ready`` barriers and set its ``end`` to "fault"
(``iteration_end``), so every waiter wakes with the same answer. A death (``GONE_KINDS``) also
marks the rank gone for the whole job and counts it at the restart barrier
(``count_once``, here), so nobody waits for it there. Writers: the rank itself (its
exception), its watchdog process (death, hard timeout), health checks, drills. Reader: the
rank that takes the restart decision (``read_faults``). Nothing here blocks.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict

from restartable.inprocess.clock import SYSTEM, Clock
from restartable.inprocess.errors import FaultRecord
from restartable.inprocess.protocol.keys import BY_NODE, GONE_KEY, OUTCOME_FAULT, key, peek
from restartable.inprocess.protocol.store import Store

# The run journal's channel (``inprocess.journal`` writes what reaches it), used the way
# checkpoint/ and rerun/ use it: the protocol sits below the journal and does not import it.
_journal = logging.getLogger("restartable.journal")

# ``restart/full``'s value when a death report, not a live rank, completed the restart barrier.
REPORT_COMPLETED = "report"

# Kinds after which the rank's process is gone: it will not arrive at any barrier.
GONE_KINDS = frozenset({"dead", "hard_timeout"})


def record_fault(store: Store, record: FaultRecord) -> None:
    """Append ``record`` to its iteration's fault list and end that iteration (wake everyone).

    Writes that never block, in one ``record_fault_batch`` (etcd: one transaction): an append,
    then first-writer-wins sets of the iteration's outcome and of its join and ready barriers,
    so ranks waiting there (monitors, barriers, reserves) all wake with the same answer at
    once. A death (``GONE_KINDS``) also counts the rank at the restart barrier, after its
    record is appended (the decider reads the records once the count is full) and BEFORE the
    iteration ends: once it ends, every rank of the job wakes and calls the store at once, and a
    count queued behind those calls took 2.7-3.4 s at 4,096 simulated ranks instead of 0.22 s
    (docs/scale.md); counted first, the death report never completes the count after a
    SIGKILL, so a live rank decides. A death costs one batch more (etcd: two transactions
    and the count). Safe to call from any process, any number of times.
    """
    it = record.iteration
    fields = asdict(record)
    gone = record.kind in GONE_KINDS
    appends = [(key(it, "faults"), json.dumps(fields) + "\n")]
    ends = [(key(it, k), OUTCOME_FAULT) for k in ("end", "join/go", "ready/go")]
    if gone:  # job-wide: no later iteration waits for this rank either
        store.record_fault_batch(
            append=[*appends, (GONE_KEY, f"{record.initial_rank},")], set_if_absent=[]
        )
        count_once(store, it, record.initial_rank)
        store.record_fault_batch(append=[], set_if_absent=ends)
    else:
        store.record_fault_batch(append=appends, set_if_absent=ends)
    if _journal.handlers:  # a journal is open (or listened to) in this process
        fields["fault_rank"] = fields.pop("initial_rank")  # "rank" is the journal writer's own
        _journal.debug("fault", extra={"journal": fields})


def report_fault(
    store: Store,
    *,
    iteration: int,
    initial_rank: int,
    kind: str,
    detail: str,
    step: int | None = None,
    clock: Clock = SYSTEM,
) -> None:
    """Record a fault of ``initial_rank`` in restart iteration ``iteration`` and wake every rank.

    ``store`` is a client of the job's coordination store (not a prefixed one). ``kind``:
    "exception", "soft_timeout", "dead", "hard_timeout", "unhealthy", ... ``step``: the rank's
    last ``ctx.step``, when known. ``clock.wall()`` stamps the record. Called by the rank
    itself, by its watchdog process, or by health checks. Idempotent in effect: a repeated
    report adds a record but the iteration ends once.
    """
    record_fault(
        store,
        FaultRecord(
            iteration=iteration,
            initial_rank=initial_rank,
            kind=kind,
            detail=detail,
            step=step,
            time=clock.wall(),
        ),
    )


def record_reserve_gone(store: Store, iteration: int, initial_rank: int) -> None:
    """A reserve's process is gone (its watchdog saw it die, or killed it at the hard timeout):
    no barrier or decision waits for it, and the ranks that train are NOT interrupted.

    Unlike ``record_fault`` this ends no iteration: a reserve takes no part in ``train()``,
    so its death costs the active ranks nothing (issue 35). It is counted at the restart
    barrier of ``iteration`` (the one its ranks meet at when the iteration faults for another
    reason), and the next decision retires it (``keys.gone_ranks``). Never blocks."""
    store.append(GONE_KEY, f"{initial_rank},")
    count_once(store, iteration, initial_rank)


def read_faults(store: Store, iteration: int) -> list[FaultRecord]:
    """Every fault recorded for ``iteration`` so far, in arrival order; never blocks."""
    raw = peek(store, key(iteration, "faults"))
    if raw is None:
        return []
    lines = raw.decode().splitlines()
    return [FaultRecord(**json.loads(line)) for line in lines if line]


def count_once(
    store: Store,
    iteration: int,
    initial_rank: int,
    *,
    expected: int | None = None,
    by: str = REPORT_COMPLETED,
) -> bool:
    """Count ``initial_rank`` at the restart barrier of ``iteration`` (once, alive or gone);
    True when this call completed the barrier.

    A live rank counts itself when it arrives (``by``: its own rank, ``expected``: the number of
    participants, which it knows); a rank reported gone is counted by the report (its watchdog
    arrives on its behalf; ``expected`` is read from the store, None before
    ``set_participants``), so the last of either completes the barrier at once. Whoever
    completes it writes ``restart/full`` = ``by`` (first writer wins): that rank decides.
    One ``count_arrival`` (two ``add`` calls on a TCPStore, one transaction on etcd), plus one
    read for a report. A report in an iteration whose ranks meet by node (``restart/expected``
    marked ``keys.BY_NODE``) only reads: nobody counts ranks on the job store there (the dead
    rank's relay counts it on its node's store, and its node on the job store). Never blocks.
    """
    if expected is None:
        raw = peek(store, key(iteration, "restart/expected"))
        if raw is not None and raw.startswith(BY_NODE.encode()):
            return False
        n = store.count_arrival(key(iteration, "restart/n"), str(initial_rank))
        if raw is None:
            return False  # no live rank has started the iteration: one of them completes it
        expected = int(raw)
        return n >= expected and _complete(store, iteration, by)
    return count_live(store, iteration, initial_rank, expected=expected, by=by)[0]


def count_live(
    store: Store, iteration: int, initial_rank: int, *, expected: int, by: str
) -> tuple[bool, int]:
    """``count_once`` with ``expected`` known (a live rank, or a live rank's re-check); also
    returns the count after this arrival (its place: ``expected`` for the last one)."""
    n = store.count_arrival(key(iteration, "restart/n"), str(initial_rank))
    return n >= expected and _complete(store, iteration, by), n


def _complete(store: Store, iteration: int, by: str) -> bool:
    return store.compare_set(key(iteration, "restart/full"), "", by).decode() == by
