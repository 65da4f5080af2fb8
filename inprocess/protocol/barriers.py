"""The counting barriers of the restart protocol (``init``, ``join``, ``ready``) and the one
bounded wait every blocking step of the protocol is built on.

Called on a rank's main thread by the restart loop (``inprocess.restart``): ``initial_barrier``
once per job, then per iteration ``join_barrier`` before the process group is created and
``ready_barrier`` after it. Each blocks until the barrier is released or its timeout passes
(``StoreTimeoutError``); time is read from the ``Clock`` passed in, so a fake clock drives a
timeout without waiting (tests/unit/test_fake_clock_barrier.py).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable

from restartable.inprocess.clock import SYSTEM, Clock
from restartable.inprocess.errors import StoreTimeoutError
from restartable.inprocess.protocol.keys import ROOT, key
from restartable.inprocess.protocol.store import Store

# How long one blocking wait lasts before a waiter re-checks for a rank that died meanwhile
# (only in rare races; c10d logs a warning for every timed-out wait, so not shorter).
RECHECK_S = 1.0


def wait_value(store: Store, key: str, seconds: float) -> bytes:
    """Block until ``key`` exists (at most ``seconds``: the store's timeout error), return it
    (etcd: the watch event carries the value; a TCPStore: ``wait``, then ``get``)."""
    return store.wait_value(key, datetime.timedelta(seconds=seconds))


def is_timeout(exc: BaseException) -> bool:
    """True when ``exc`` is a store's timeout (c10d raises ``DistStoreError`` naming it)."""
    return isinstance(exc, TimeoutError) or "timeout" in str(exc).lower()


def wait_released(
    store: Store,
    go_key: str,
    *,
    deadline: float,
    clock: Clock,
    what: str,
    recheck: Callable[[], bool] | None = None,
) -> str | None:
    """Wait for ``go_key`` until ``clock.monotonic()`` reaches ``deadline``; return its value.

    With ``recheck``, wait in steps of ``RECHECK_S`` and call it after each: True stops the
    wait and returns None (the caller acts on what the re-check found). Raises
    ``StoreTimeoutError`` naming ``what`` at the deadline.
    """
    while True:
        left = deadline - clock.monotonic()
        if left <= 0:
            raise StoreTimeoutError(f"{what} did not complete within its timeout")
        step = left if recheck is None else min(left, RECHECK_S)
        try:
            return wait_value(store, go_key, step).decode()
        except Exception as exc:
            if not is_timeout(exc):
                raise
            if recheck is not None and recheck():
                return None


def counting_barrier(
    store: Store,
    name: str,
    *,
    expected: int,
    timeout: float,
    clock: Clock = SYSTEM,
    recheck: Callable[[], bool] | None = None,
) -> str:
    """Arrive at barrier ``name`` of ``expected`` ranks; return its release value.

    Two round trips per rank (an ``add``, then a ``wait`` on one release key); the last arrival
    releases it with "ok" (its ``compare_set`` answers it, no wait). Anyone may release it
    earlier with another value (a fault breaks the ``join`` barrier with "fault"). ``recheck``
    runs every ``RECHECK_S`` while waiting; True means it released the barrier (the wait then
    reads the value it wrote). Raises ``StoreTimeoutError`` after ``timeout`` seconds.
    """
    go = f"{name}/go"
    deadline = clock.monotonic() + timeout
    # TCPStore: one add; etcd: one transaction per arrival (a put of its own key and a count)
    # instead of a compare-and-swap loop on one hot counter.
    if store.count_arrival(f"{name}/n") >= expected:
        # The answer is the value now stored: "ok", or what broke the barrier first. No wait.
        return store.compare_set(go, "", "ok").decode()
    what = f"barrier {name!r}"
    while True:
        value = wait_released(store, go, deadline=deadline, clock=clock, what=what, recheck=recheck)
        if value is not None:
            return value


def join_barrier(
    store: Store,
    iteration: int,
    *,
    expected: int,
    timeout: float,
    clock: Clock = SYSTEM,
    recheck: Callable[[], bool] | None = None,
) -> bool:
    """Active ranks meet before ``train()`` of ``iteration``; False when a fault broke it.

    ``recheck`` runs every ``RECHECK_S`` while waiting (the wrapper breaks the barrier there
    when an active rank died during the restart, which no fault of this iteration reports).
    """
    value = counting_barrier(
        store,
        key(iteration, "join"),
        expected=expected,
        timeout=timeout,
        clock=clock,
        recheck=recheck,
    )
    return value == "ok"


def ready_barrier(
    store: Store, iteration: int, *, expected: int, timeout: float, clock: Clock = SYSTEM
) -> bool:
    """Active ranks meet after creating the process group; False when a fault broke it.

    Nobody starts ``train()`` before every rank finished ``init_process_group``: a rank still
    inside gloo's connect when a peer faults could not be released until the init timeout.
    """
    value = counting_barrier(
        store, key(iteration, "ready"), expected=expected, timeout=timeout, clock=clock
    )
    return value == "ok"


def initial_barrier(
    store: Store, *, world_size: int, timeout: float, clock: Clock = SYSTEM
) -> None:
    """Every rank of the job arrives once before the first iteration (bounded by ``timeout``)."""
    counting_barrier(store, f"{ROOT}init", expected=world_size, timeout=timeout, clock=clock)
