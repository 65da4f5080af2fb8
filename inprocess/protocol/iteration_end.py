"""How a restart iteration ends: its outcome (``"fault"`` or ``"done"``), waited for or read.

The outcome is the iteration's ``end`` key (``keys``), first writer wins: a fault record sets
it to "fault" (``fault_records``), the last active rank to return from ``train()`` to "done"
(``mark_completed``). Read by the monitors, the ranks waiting for completion and the reserves
(``wait_outcome`` blocks; ``outcome`` never does).
"""

from __future__ import annotations

import secrets

from restartable.checkpoint.sealing import ForgedValueError
from restartable.inprocess.clock import SYSTEM, Clock
from restartable.inprocess.protocol.barriers import is_timeout, wait_value
from restartable.inprocess.protocol.keys import OUTCOME_DONE, OUTCOME_FAULT, end_key, key, peek
from restartable.inprocess.protocol.store import Store


def outcome(store: Store, iteration: int) -> str | None:
    """``"fault"``, ``"done"`` or None (the iteration is still running); never blocks.

    A value that fails to verify (``ForgedValueError``, already logged naming the key) is a
    fault: someone broke the iteration, and every reader must end it alike, never stop
    watching it (found by issue 46: a garbage ``end`` switched hang detection off)."""
    try:
        raw = peek(store, end_key(iteration))
    except ForgedValueError:
        return OUTCOME_FAULT
    return None if raw is None else raw.decode()


def wait_outcome(
    store: Store, iteration: int, *, timeout: float | None, clock: Clock = SYSTEM
) -> str | None:
    """Block until ``iteration`` ends; return its outcome, or None after ``timeout`` seconds.

    ``timeout=None`` waits for as long as the iteration runs (reserves), in bounded waits.
    """
    end = end_key(iteration)
    deadline = None if timeout is None else clock.monotonic() + timeout
    while True:
        left = 3600.0 if deadline is None else deadline - clock.monotonic()
        if left <= 0:
            return None
        try:
            return wait_value(store, end, min(left, 3600.0)).decode()
        except ForgedValueError:  # logged by the sealed store, naming the key: see outcome()
            return OUTCOME_FAULT
        except Exception as exc:  # DistStoreError on timeout; anything else is fatal
            if not is_timeout(exc):
                raise


def mark_completed(store: Store, iteration: int, *, active: int) -> None:
    """An active rank's ``train()`` returned; the last of ``active`` ends the iteration "done".

    "done" (what ends a job with status 0) needs evidence from every active rank: each appends
    a sealed token of its own to ``done/ranks`` before it counts, and the rank whose count
    completes writes "done" only when that list holds ``active`` distinct tokens. The counter
    is a plain integer anyone on the store may add to; inflated, it only makes an earlier rank
    look at an incomplete list and leave the write to the last one."""
    store.append(key(iteration, "done/ranks"), secrets.token_hex(8) + ",")
    if store.add(key(iteration, "done/n"), 1) < active:
        return
    tokens = {t for t in (peek(store, key(iteration, "done/ranks")) or b"").decode().split(",")}
    if len(tokens - {""}) >= active:
        store.compare_set(end_key(iteration), "", OUTCOME_DONE)
