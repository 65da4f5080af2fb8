"""Every key and barrier the restart protocol keeps in the coordination store.

Layout (all under ``restartable/``): ``it{n}/`` is restart iteration ``n``'s namespace, so no key
of an earlier iteration is ever read again. Inside it:

* ``faults``        appended JSON lines, one ``FaultRecord`` each
* ``end``           first writer wins: ``"fault"`` (any fault) or ``"done"`` (all active ranks
                    returned); every monitor and every waiting rank blocks on this one key
* ``join/*``        the barrier active ranks pass before creating the process group
* ``ready/*``       the barrier they pass after it, before ``train()``; a fault breaks both
* ``done/*``        the completion counter (``n``) and every completed rank's token
                    (``ranks``): the evidence behind "done"
* ``restart/*``     the barrier after a fault (live ranks and death reports count once each:
                    ``counted/<rank>``, ``n``); ``full`` names who completed the count, who
                    takes the decision (``decider``: the claim when a death report
                    completed it); ``go`` is the decision (JSON), first writer wins, so
                    every rank reads the same one; every waiter blocks on ``go`` alone
* ``pg/``           the prefix handed to ``init_process_group`` and to ``ctx.store``
* ``reserves``      the iteration's warm reserves (``inprocess.restart.demotion`` checks one is
free),
                    as ranges (``ranks.encode_ranks``)

Cost at scale (docs/scale.md, ``benchmarks/restart_scale.py``): every rank makes a constant
number of calls per restart and reads no value that lists every rank, except the decision, whose
assignment is run-length encoded; exactly one rank takes the decision; every wait is a blocking
``wait`` on one key (re-checked every ``_RECHECK_S`` for the rare races), never a poll.
"""

from __future__ import annotations

import datetime
import json
import logging
import secrets
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import asdict

from checkpoint.sealing import ForgedValueError
from inprocess import journal
from inprocess.errors import FaultRecord, StoreTimeoutError
from inprocess.protocol.ranks import decode_ranks, encode_ranks
from inprocess.protocol.store import Store

log = logging.getLogger(__name__)

ROOT = "restartable/"
GONE_KEY = ROOT + "gone"
OUTCOME_FAULT = "fault"
OUTCOME_DONE = "done"
# Kinds after which the rank's process is gone: it will not arrive at any barrier.
GONE_KINDS = frozenset({"dead", "hard_timeout"})
# How long one blocking wait lasts before a waiter re-checks for a rank that died meanwhile
# (only in rare races; c10d logs a warning for every timed-out wait, so not shorter).
_RECHECK_S = 1.0
# ``restart/full``'s value when a death report, not a live rank, completed the restart barrier.
REPORT_COMPLETED = "report"


# The store as this module sees it (the name other modules import).
StoreLike = Store


def peek(store: Store, key: str) -> bytes | None:
    """The value of ``key``, or None when it is absent; never blocks, never writes (etcd: one
    range request; a TCPStore: ``check``, then ``get``)."""
    return store.try_get(key)


def peek_many(store: Store, keys: Sequence[str]) -> list[bytes | None]:
    """``peek`` of several keys (etcd: one transaction; a TCPStore: one by one). Never blocks,
    never writes."""
    return store.try_get_many(list(keys))


def set_many(store: Store, values: Mapping[str, str]) -> None:
    """Set several keys in one ``multi_set`` (the TCPStore and etcd: one round trip /
    transaction)."""
    store.multi_set(list(values), list(values.values()))


def parse_ranks(raw: bytes | None) -> set[int]:
    """The ranks of a comma-separated list value (``gone``, ``joiners``); empty when absent."""
    return set() if raw is None else {int(x) for x in raw.decode().split(",") if x}


def iteration_prefix(iteration: int) -> str:
    """The key prefix of restart iteration ``iteration`` (for ``PrefixStore`` and tests)."""
    return f"{ROOT}it{iteration}/"


def _key(iteration: int, name: str) -> str:
    return iteration_prefix(iteration) + name


def record_fault(store: Store, record: FaultRecord) -> None:
    """Append ``record`` to its iteration's fault list and end that iteration (wake everyone).

    Writes that never block, in one ``record_fault_batch`` (etcd: one transaction): an append,
    then first-writer-wins sets of the iteration's outcome and of its join and ready barriers,
    so ranks waiting there (monitors, barriers, reserves) all wake with the same answer at
    once. A death (``GONE_KINDS``) also counts the rank at the restart barrier, after its
    record is appended (the decider reads the records once the count is full). Safe to call
    from any process, any number of times.
    """
    it = record.iteration
    fields = asdict(record)
    gone = record.kind in GONE_KINDS
    store.record_fault_batch(
        append=[(_key(it, "faults"), json.dumps(fields) + "\n")]
        + ([(GONE_KEY, f"{record.initial_rank},")] if gone else []),
        set_if_absent=[(_key(it, k), OUTCOME_FAULT) for k in ("end", "join/go", "ready/go")],
    )
    fields["fault_rank"] = fields.pop("initial_rank")  # "rank" is the journal writer's own
    journal.record("fault", **fields)
    if gone:  # job-wide: no later iteration waits for this rank either
        _count_once(store, it, record.initial_rank)


def report_fault(
    store: Store,
    *,
    iteration: int,
    initial_rank: int,
    kind: str,
    detail: str,
    step: int | None = None,
) -> None:
    """Record a fault of ``initial_rank`` in restart iteration ``iteration`` and wake every rank.

    ``store`` is a client of the job's coordination store (not a prefixed one). ``kind``:
    "exception", "soft_timeout", "dead", "hard_timeout", "unhealthy", ... ``step``: the rank's
    last ``ctx.step``, when known. Called by the rank itself, by its watchdog process, or by
    health checks. Idempotent in effect: a repeated report adds a record but the iteration ends
    once.
    """
    record_fault(
        store,
        FaultRecord(
            iteration=iteration,
            initial_rank=initial_rank,
            kind=kind,
            detail=detail,
            step=step,
            time=time.time(),
        ),
    )


def record_reserve_gone(store: Store, iteration: int, initial_rank: int) -> None:
    """A reserve's process is gone (its watchdog saw it die, or killed it at the hard timeout):
    no barrier or decision waits for it, and the ranks that train are NOT interrupted.

    Unlike ``record_fault`` this ends no iteration: a reserve takes no part in ``train()``,
    so its death costs the active ranks nothing (issue 35). It is counted at the restart
    barrier of ``iteration`` (the one its ranks meet at when the iteration faults for another
    reason), and the next decision retires it (``gone_ranks``). Never blocks."""
    store.append(GONE_KEY, f"{initial_rank},")
    _count_once(store, iteration, initial_rank)


def read_faults(store: Store, iteration: int) -> list[FaultRecord]:
    """Every fault recorded for ``iteration`` so far, in arrival order."""
    raw = peek(store, _key(iteration, "faults"))
    if raw is None:
        return []
    lines = raw.decode().splitlines()
    return [FaultRecord(**json.loads(line)) for line in lines if line]


def gone_ranks(store: Store) -> set[int]:
    """Initial ranks whose process is known to be gone (any iteration); never blocks."""
    return parse_ranks(peek(store, GONE_KEY))


def outcome(store: Store, iteration: int) -> str | None:
    """``"fault"``, ``"done"`` or None (the iteration is still running); never blocks.

    A value that fails to verify (``ForgedValueError``, already logged naming the key) is a
    fault: someone broke the iteration, and every reader must end it alike, never stop
    watching it (found by issue 46: a garbage ``end`` switched hang detection off)."""
    try:
        raw = peek(store, _key(iteration, "end"))
    except ForgedValueError:
        return OUTCOME_FAULT
    return None if raw is None else raw.decode()


def end_key(iteration: int) -> str:
    """The key every waiter of ``iteration`` blocks on (see ``wait_outcome``)."""
    return _key(iteration, "end")


def wait_outcome(
    store: Store, iteration: int, *, timeout: float | None, clock: Callable[[], float]
) -> str | None:
    """Block until ``iteration`` ends; return its outcome, or None after ``timeout`` seconds.

    ``timeout=None`` waits for as long as the iteration runs (reserves), in bounded waits.
    """
    key = end_key(iteration)
    deadline = None if timeout is None else clock() + timeout
    while True:
        left = 3600.0 if deadline is None else deadline - clock()
        if left <= 0:
            return None
        try:
            return _wait_value(store, key, min(left, 3600.0)).decode()
        except ForgedValueError:  # logged by the sealed store, naming the key: see outcome()
            return OUTCOME_FAULT
        except Exception as exc:  # DistStoreError on timeout; anything else is fatal
            if not _is_timeout(exc):
                raise


def _wait_value(store: Store, key: str, seconds: float) -> bytes:
    """Block until ``key`` exists (at most ``seconds``: the store's timeout error), return it
    (etcd: the watch event carries the value; a TCPStore: ``wait``, then ``get``)."""
    return store.wait_value(key, datetime.timedelta(seconds=seconds))


def _is_timeout(exc: BaseException) -> bool:
    return isinstance(exc, TimeoutError) or "timeout" in str(exc).lower()


def _wait_released(
    store: Store,
    go_key: str,
    *,
    deadline: float,
    clock: Callable[[], float],
    what: str,
    recheck: Callable[[], bool] | None = None,
) -> str:
    """Wait for ``go_key``; every ``_RECHECK_S`` call ``recheck`` (True: it released the key)."""
    while True:
        left = deadline - clock()
        if left <= 0:
            raise StoreTimeoutError(f"{what} did not complete within its timeout")
        step = left if recheck is None else min(left, _RECHECK_S)
        try:
            return _wait_value(store, go_key, step).decode()
        except Exception as exc:
            if not _is_timeout(exc):
                raise
            if recheck is not None:
                recheck()


def counting_barrier(
    store: Store,
    name: str,
    *,
    expected: int,
    timeout: float,
    clock: Callable[[], float] = time.monotonic,
    recheck: Callable[[], bool] | None = None,
) -> str:
    """Arrive at barrier ``name`` of ``expected`` ranks; return its release value.

    Two round trips per rank (an ``add``, then a ``wait`` on one release key); the last arrival
    releases it with "ok" (its ``compare_set`` answers it, no wait). Anyone may release it
    earlier with another value (a fault breaks the ``join`` barrier with "fault"). Raises
    ``StoreTimeoutError`` after ``timeout`` seconds.
    """
    go = f"{name}/go"
    deadline = clock() + timeout
    # TCPStore: one add; etcd: one transaction per arrival (a put of its own key and a count)
    # instead of a compare-and-swap loop on one hot counter.
    if store.count_arrival(f"{name}/n") >= expected:
        # The answer is the value now stored: "ok", or what broke the barrier first. No wait.
        return store.compare_set(go, "", "ok").decode()
    return _wait_released(
        store, go, deadline=deadline, clock=clock, what=f"barrier {name!r}", recheck=recheck
    )


def join_barrier(
    store: Store,
    iteration: int,
    *,
    expected: int,
    timeout: float,
    clock: Callable[[], float],
    recheck: Callable[[], bool] | None = None,
) -> bool:
    """Active ranks meet before ``train()`` of ``iteration``; False when a fault broke it.

    ``recheck`` runs every ``_RECHECK_S`` while waiting (the wrapper breaks the barrier there
    when an active rank died during the restart, which no fault of this iteration reports).
    """
    value = counting_barrier(
        store,
        _key(iteration, "join"),
        expected=expected,
        timeout=timeout,
        clock=clock,
        recheck=recheck,
    )
    return value == "ok"


def ready_barrier(
    store: Store, iteration: int, *, expected: int, timeout: float, clock: Callable[[], float]
) -> bool:
    """Active ranks meet after creating the process group; False when a fault broke it.

    Nobody starts ``train()`` before every rank finished ``init_process_group``: a rank still
    inside gloo's connect when a peer faults could not be released until the init timeout.
    """
    value = counting_barrier(
        store, _key(iteration, "ready"), expected=expected, timeout=timeout, clock=clock
    )
    return value == "ok"


def initial_barrier(
    store: Store, *, world_size: int, timeout: float, clock: Callable[[], float]
) -> None:
    """Every rank of the job arrives once before the first iteration (bounded by ``timeout``)."""
    counting_barrier(store, f"{ROOT}init", expected=world_size, timeout=timeout, clock=clock)


def mark_completed(store: Store, iteration: int, *, active: int) -> None:
    """An active rank's ``train()`` returned; the last of ``active`` ends the iteration "done".

    "done" (what ends a job with status 0) needs evidence from every active rank: each appends
    a sealed token of its own to ``done/ranks`` before it counts, and the rank whose count
    completes writes "done" only when that list holds ``active`` distinct tokens. The counter
    is a plain integer anyone on the store may add to; inflated, it only makes an earlier rank
    look at an incomplete list and leave the write to the last one."""
    store.append(_key(iteration, "done/ranks"), secrets.token_hex(8) + ",")
    if store.add(_key(iteration, "done/n"), 1) < active:
        return
    tokens = {t for t in (peek(store, _key(iteration, "done/ranks")) or b"").decode().split(",")}
    if len(tokens - {""}) >= active:
        store.compare_set(_key(iteration, "end"), "", OUTCOME_DONE)


def set_participants(store: Store, iteration: int, count: int) -> None:
    """How many ranks (active + reserve) take part in ``iteration``; every rank writes it."""
    store.set(*participants_item(iteration, count))


def participants_item(iteration: int, count: int) -> tuple[str, str]:
    """The key and value ``set_participants`` writes (for one ``set_many`` with others)."""
    return _key(iteration, "restart/expected"), str(count)


def set_reserves(store: Store, iteration: int, reserves: Sequence[int]) -> None:
    """The warm reserves (initial ranks) of ``iteration``; every rank writes the same value."""
    store.set(*reserves_item(iteration, reserves))


def reserves_item(iteration: int, reserves: Sequence[int]) -> tuple[str, str]:
    """The key and value ``set_reserves`` writes. Run-length encoded (``ranks.encode_ranks``):
    reserves are mostly consecutive ranks, so the value stays a few bytes however many ranks
    the job has, and every rank writes it."""
    return _key(iteration, "reserves"), encode_ranks(reserves)


def reserves(store: Store, iteration: int) -> tuple[int, ...]:
    """The warm reserves of ``iteration`` (``set_reserves``; () when unknown); never blocks."""
    raw = peek(store, _key(iteration, "reserves"))
    return () if raw is None else decode_ranks(raw.decode())


def _count_once(
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
    read for a report.
    """
    n = store.count_arrival(_key(iteration, "restart/n"), str(initial_rank))
    if expected is None:
        raw = peek(store, _key(iteration, "restart/expected"))
        if raw is None:
            return False  # no live rank has started the iteration: one of them completes it
        expected = int(raw)
    if n < expected:
        return False
    return store.compare_set(_key(iteration, "restart/full"), "", by).decode() == by


def restart_barrier(
    store: Store,
    iteration: int,
    *,
    initial_rank: int,
    participants: Collection[int],
    decide: Callable[[list[FaultRecord]], str],
    timeout: float,
    clock: Callable[[], float] = time.monotonic,
) -> str:
    """Every live participant meets after iteration ``iteration`` faulted; returns the decision.

    Called by every live participant (active and reserve) once its part of the iteration is
    over; blocks until the decision is published, at most ``timeout`` seconds
    (``StoreTimeoutError``). ``participants``: the initial ranks of the iteration (their number
    was published with ``set_participants``). A rank reported gone (``GONE_KINDS``) is counted
    by the report itself, so nobody waits for it, whichever comes first.

    Exactly one rank runs ``decide(faults)``: the live rank whose arrival completed the count,
    or, when a death report completed it (the dying rank came last), the first live rank to
    claim ``restart/decider``. Everyone waits for the count's completion (``restart/full``),
    then the others block on ``go``, the decision; the first decision published wins
    (compare-and-set), so all ranks continue with the same one even if more faults are
    recorded later. Per rank: two ``add`` and two waits for a value, whatever the number of
    ranks; no value that lists every rank is read except the decision (run-length encoded).

    Rare cases, handled by the re-check every ``_RECHECK_S`` of a waiter (so they cost up to
    that much more): the decider died before publishing (reported gone: a waiter decides in
    its place); a participant whose death was reported for an earlier iteration (it died during
    the previous restart) is counted by a waiter.
    """
    meeting = _RestartMeeting(store, iteration, str(initial_rank), set(participants), decide)
    return meeting.run(deadline=clock() + timeout, clock=clock)


class _RestartMeeting:
    """One live rank's part of ``restart_barrier`` (the state its re-checks share)."""

    def __init__(
        self,
        store: Store,
        iteration: int,
        me: str,
        members: set[int],
        decide: Callable[[list[FaultRecord]], str],
    ) -> None:
        self.store, self.iteration, self.me, self.members = store, iteration, me, members
        self.decide = decide
        self.full, self.go, self.claim = (
            _key(iteration, f"restart/{k}") for k in ("full", "go", "decider")
        )
        self.what = f"restart barrier {iteration}"

    def run(self, *, deadline: float, clock: Callable[[], float]) -> str:
        store, me = self.store, self.me
        if _count_once(store, self.iteration, int(me), expected=len(self.members), by=me):
            return self.publish()
        # First the count's completion, not the decision: when a death report completed it
        # (the killed rank's report came last, as after most SIGKILLs) no live rank did, and a
        # waiter must decide now, not at its next re-check (measured: one restart in three took
        # 1 s more by benchmarks/restart_latency.py --quick). One more wait per rank, whatever
        # the number.
        who = _wait_released(
            store, self.full, deadline=deadline, clock=clock, what=self.what,
            recheck=self.count_gone,
        )  # fmt: skip
        if who == REPORT_COMPLETED:
            who = store.compare_set(self.claim, "", me).decode()  # the first claim decides
        if who == me:
            return self.publish()
        return _wait_released(
            store, self.go, deadline=deadline, clock=clock, what=self.what,
            recheck=self.decide_for_the_gone,
        )  # fmt: skip

    def publish(self) -> str:
        faults = read_faults(self.store, self.iteration)
        return self.store.compare_set(self.go, "", self.decide(faults)).decode()

    def count_gone(self) -> bool:
        """Count the participants reported gone (for an earlier iteration); True when that
        completed the count (``restart/full`` is now this rank: the wait returns it)."""
        for r in sorted(gone_ranks(self.store) & self.members):
            if _count_once(self.store, self.iteration, r, expected=len(self.members), by=self.me):
                return True
        return False

    def decide_for_the_gone(self) -> bool:
        """``restart/full`` is set (waited for): its rank, or the first claimant, decides; a
        waiter decides in its place when that rank is gone. True when this rank published."""
        store, me = self.store, self.me
        who = store.get(self.full).decode()
        if who == REPORT_COMPLETED:
            who = store.compare_set(self.claim, "", me).decode()
        if who == me or (who.isdigit() and int(who) in gone_ranks(store)):
            self.publish()
            return True
        return False  # the decider is alive and deciding


def pg_prefix(iteration: int) -> str:
    """The prefix under which iteration ``iteration``'s process group and ``ctx.store`` live."""
    return _key(iteration, "pg")


def describe_keys(iteration: int) -> Sequence[str]:
    """The well-known keys of ``iteration`` (for debugging tools)."""
    return [_key(iteration, k) for k in ("faults", "end", "join/go", "restart/go")]
