"""Every key and barrier the restart protocol keeps in the coordination store.

Layout (all under ``restartable/``): ``it{n}/`` is restart iteration ``n``'s namespace, so no key
of an earlier iteration is ever read again. Inside it:

* ``faults``        appended JSON lines, one ``FaultRecord`` each
* ``end``           first writer wins: ``"fault"`` (any fault) or ``"done"`` (all active ranks
                    returned); every monitor and every waiting rank blocks on this one key
* ``join/*``        the barrier active ranks pass before creating the process group
* ``ready/*``       the barrier they pass after it, before ``train()``; a fault breaks both
* ``done/*``        the completion counter
* ``restart/*``     the barrier after a fault (live ranks and death reports count once each);
                    ``restart/go`` is the next assignment (JSON), first writer wins, so every
                    rank reads the same one
* ``pg/``           the prefix handed to ``init_process_group`` and to ``ctx.store``
* ``reserves``      the iteration's warm reserves (``inprocess.demotion`` checks one is free)
"""

from __future__ import annotations

import datetime
import json
import logging
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict
from typing import Any, Protocol

from inprocess import journal
from inprocess.errors import FaultRecord, StoreTimeoutError

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


class StoreLike(Protocol):
    """The subset of ``torch.distributed.Store`` this module uses (a fake store implements it)."""

    def set(self, key: str, value: str | bytes) -> None: ...
    def get(self, key: str) -> bytes: ...
    def add(self, key: str, value: int) -> int: ...
    def append(self, key: str, value: str | bytes) -> None: ...
    def compare_set(self, key: str, expected_value: str, desired_value: str) -> bytes: ...
    def check(self, keys: list[str]) -> bool: ...
    def wait(self, keys: list[str], timeout: datetime.timedelta) -> None: ...


def iteration_prefix(iteration: int) -> str:
    """The key prefix of restart iteration ``iteration`` (for ``PrefixStore`` and tests)."""
    return f"{ROOT}it{iteration}/"


def _key(iteration: int, name: str) -> str:
    return iteration_prefix(iteration) + name


def record_fault(store: StoreLike, record: FaultRecord) -> None:
    """Append ``record`` to its iteration's fault list and end that iteration (wake everyone).

    Two writes that never block: an append, then first-writer-wins sets of the iteration's
    outcome and of its join barrier, so ranks waiting there (monitors, barriers, reserves)
    all wake with the same answer at once. Safe to call from any process, any number of times.
    """
    it = record.iteration
    fields = asdict(record)
    store.append(_key(it, "faults"), json.dumps(fields) + "\n")
    fields["fault_rank"] = fields.pop("initial_rank")  # "rank" is the journal writer's own
    journal.record("fault", **fields)
    if record.kind in GONE_KINDS:  # job-wide: no later iteration waits for this rank either
        store.append(GONE_KEY, f"{record.initial_rank},")
        _count_once(store, it, record.initial_rank)
    store.compare_set(_key(it, "end"), "", OUTCOME_FAULT)
    store.compare_set(_key(it, "join/go"), "", OUTCOME_FAULT)
    store.compare_set(_key(it, "ready/go"), "", OUTCOME_FAULT)


def report_fault(
    store: Any,
    *,
    iteration: int,
    initial_rank: int,
    kind: str,
    detail: str,
    step: int | None = None,
) -> None:
    """Record a fault of ``initial_rank`` in restart iteration ``iteration`` and wake every rank.

    ``store`` is a client of the job's coordination store (``torch.distributed.Store``, not a
    prefixed one). ``kind``: "exception", "soft_timeout", "dead", "hard_timeout", "unhealthy",
    ... ``step``: the rank's last ``ctx.step``, when known. Called by the rank itself, by its
    watchdog process, or by health checks. Idempotent in
    effect: a repeated report adds a record but the iteration ends once.
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


def read_faults(store: StoreLike, iteration: int) -> list[FaultRecord]:
    """Every fault recorded for ``iteration`` so far, in arrival order."""
    key = _key(iteration, "faults")
    if not store.check([key]):
        return []
    lines = store.get(key).decode().splitlines()
    return [FaultRecord(**json.loads(line)) for line in lines if line]


def gone_ranks(store: StoreLike) -> set[int]:
    """Initial ranks whose process is known to be gone (any iteration); never blocks."""
    if not store.check([GONE_KEY]):
        return set()
    return {int(x) for x in store.get(GONE_KEY).decode().split(",") if x}


def outcome(store: StoreLike, iteration: int) -> str | None:
    """``"fault"``, ``"done"`` or None (the iteration is still running); never blocks."""
    key = _key(iteration, "end")
    return store.get(key).decode() if store.check([key]) else None


def end_key(iteration: int) -> str:
    """The key every waiter of ``iteration`` blocks on (see ``wait_outcome``)."""
    return _key(iteration, "end")


def wait_outcome(
    store: StoreLike, iteration: int, *, timeout: float | None, clock: Callable[[], float]
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
            store.wait([key], datetime.timedelta(seconds=min(left, 3600.0)))
        except Exception as exc:  # DistStoreError on timeout; anything else is fatal
            if not _is_timeout(exc):
                raise
            continue
        return store.get(key).decode()


def _is_timeout(exc: BaseException) -> bool:
    return isinstance(exc, TimeoutError) or "timeout" in str(exc).lower()


def _wait_released(
    store: StoreLike,
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
            store.wait([go_key], datetime.timedelta(seconds=step))
        except Exception as exc:
            if not _is_timeout(exc):
                raise
            if recheck is not None:
                recheck()
            continue
        return store.get(go_key).decode()


def counting_barrier(
    store: StoreLike,
    name: str,
    *,
    expected: int,
    timeout: float,
    clock: Callable[[], float] = time.monotonic,
    recheck: Callable[[], bool] | None = None,
) -> str:
    """Arrive at barrier ``name`` of ``expected`` ranks; return its release value.

    Two round trips per rank (an ``add``, then a ``wait`` on one release key); the last arrival
    releases it with "ok". Anyone may release it earlier with another value (a fault breaks the
    ``join`` barrier with "fault"). Raises ``StoreTimeoutError`` after ``timeout`` seconds.
    """
    go = f"{name}/go"
    deadline = clock() + timeout
    if store.add(f"{name}/n", 1) >= expected:
        store.compare_set(go, "", "ok")
    return _wait_released(
        store, go, deadline=deadline, clock=clock, what=f"barrier {name!r}", recheck=recheck
    )


def join_barrier(
    store: StoreLike,
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
    store: StoreLike, iteration: int, *, expected: int, timeout: float, clock: Callable[[], float]
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
    store: StoreLike, *, world_size: int, timeout: float, clock: Callable[[], float]
) -> None:
    """Every rank of the job arrives once before the first iteration (bounded by ``timeout``)."""
    counting_barrier(store, f"{ROOT}init", expected=world_size, timeout=timeout, clock=clock)


def mark_completed(store: StoreLike, iteration: int, *, active: int) -> None:
    """An active rank's ``train()`` returned; the last of ``active`` ends the iteration "done"."""
    if store.add(_key(iteration, "done/n"), 1) >= active:
        store.compare_set(_key(iteration, "end"), "", OUTCOME_DONE)


def set_participants(store: StoreLike, iteration: int, count: int) -> None:
    """How many ranks (active + reserve) take part in ``iteration``; every rank writes it."""
    store.set(_key(iteration, "restart/expected"), str(count))


def set_reserves(store: StoreLike, iteration: int, reserves: Sequence[int]) -> None:
    """The warm reserves (initial ranks) of ``iteration``; every rank writes the same value."""
    store.set(_key(iteration, "reserves"), ",".join(map(str, reserves)))


def reserves(store: StoreLike, iteration: int) -> tuple[int, ...]:
    """The warm reserves of ``iteration`` (``set_reserves``; () when unknown); never blocks."""
    key = _key(iteration, "reserves")
    if not store.check([key]):
        return ()
    return tuple(int(x) for x in store.get(key).decode().split(",") if x)


def _count_once(store: StoreLike, iteration: int, initial_rank: int) -> None:
    """Count ``initial_rank`` at the restart barrier of ``iteration`` (once, alive or gone).

    A live rank counts itself when it arrives; a rank reported gone is counted by the report
    (its watchdog arrives on its behalf), so the last of either completes the barrier at once.
    """
    if store.add(_key(iteration, f"restart/counted/{initial_rank}"), 1) != 1:
        return
    n = store.add(_key(iteration, "restart/n"), 1)
    expected = _key(iteration, "restart/expected")
    if store.check([expected]) and n >= int(store.get(expected)):
        store.set(_key(iteration, "restart/full"), "1")


def restart_barrier(
    store: StoreLike,
    iteration: int,
    *,
    initial_rank: int,
    participants: Collection[int],
    decide: Callable[[list[FaultRecord]], str],
    timeout: float,
    clock: Callable[[], float] = time.monotonic,
) -> str:
    """Every live participant meets after iteration ``iteration`` faulted; returns the decision.

    ``participants``: the initial ranks of the iteration (active and reserve; their number was
    published with ``set_participants``). A rank reported gone (``GONE_KINDS``) is counted by
    the report itself, so nobody waits for it, whichever comes first. Once all are counted,
    ranks call ``decide(faults)``; the first published decision wins (compare-and-set), so all
    ranks continue with the same one even if more faults are recorded later. A re-check every
    ``_RECHECK_S`` covers a report that came before ``set_participants``. Raises
    ``StoreTimeoutError`` after ``timeout`` seconds.
    """
    who, full, go = (_key(iteration, f"restart/{k}") for k in ("who", "full", "go"))
    store.append(who, f"{initial_rank},")
    _count_once(store, iteration, initial_rank)
    deadline = clock() + timeout

    def recheck() -> bool:
        gone = gone_ranks(store)
        arrived = {int(x) for x in store.get(who).decode().split(",") if x}
        if set(participants) - gone <= arrived:
            store.set(full, "1")
            return True
        return False

    if not store.check([full]):
        recheck()
    _wait_released(
        store,
        full,
        deadline=deadline,
        clock=clock,
        what=f"restart barrier {iteration}",
        recheck=recheck,
    )
    if not store.check([go]):
        store.compare_set(go, "", decide(read_faults(store, iteration)))
    return store.get(go).decode()


def pg_prefix(iteration: int) -> str:
    """The prefix under which iteration ``iteration``'s process group and ``ctx.store`` live."""
    return _key(iteration, "pg")


def describe_keys(iteration: int) -> Sequence[str]:
    """The well-known keys of ``iteration`` (for debugging tools)."""
    return [_key(iteration, k) for k in ("faults", "end", "join/go", "restart/go")]
