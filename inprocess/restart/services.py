"""What the restart loop owns and lends to every iteration of one rank: ``RankServices``.

Built once per process by ``inprocess.restart.startup.rank_services`` and closed by the loop's
lifetime (``inprocess.restart.lifetime``); read by the active iteration
(``inprocess.restart.active``) and the reserve's (``inprocess.restart.reserve``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from restartable.inprocess.clock import Clock
from restartable.inprocess.config import RestartConfig
from restartable.inprocess.protocol.store import Store
from restartable.inprocess.restart.interrupter import Interrupter
from restartable.inprocess.restart.progress import ProgressTracker
from restartable.inprocess.restart.rendezvous import Rendezvous
from restartable.inprocess.timeouts.sections import SectionClock


@dataclass(frozen=True)
class RankServices:
    """What the loop owns and lends to every iteration of this rank (the loop closes them).

    ``abort`` tears down this rank's groups and keeps them for ``release`` (monitor or main
    thread); ``release`` hands them to the reaper once ``train()``'s frames are gone;
    ``new_client`` opens a store client for a blocking wait, and ``clients`` keeps the
    monitors' clients between iterations; ``sections`` times ``ctx.section()`` and keeps the
    learned timeouts across iterations; ``rendezvous`` gives the store each iteration's group
    is created over; ``clock`` is the loop's, for every wait and timing of an iteration.
    """

    config: RestartConfig
    me: int
    local_rank: int
    store: Store
    report_store: Store
    new_client: Callable[[], Store]
    progress: ProgressTracker
    interrupter: Interrupter
    abort: Callable[[], None]
    release: Callable[[], None]
    sections: SectionClock
    rendezvous: Rendezvous
    clients: ClientPool
    clock: Clock


class ClientPool:
    """Idle store clients for the monitors' blocking waits, kept across iterations.

    Opening a client costs a connect (an etcd client: a request, 4-12 ms measured on the
    restart path); the monitor's store thread hands its client back once its wait ended with
    the iteration's outcome, so the next iteration's monitor starts without a connect. A
    client whose wait did not end (a rank that leaves mid-iteration) is never handed back.
    Thread-safe.
    """

    def __init__(self, open_client: Callable[[], Store]) -> None:
        self._open = open_client
        self._idle: list[Store] = []
        self._lock = threading.Lock()

    def take(self) -> Store:
        """An idle client, or a new one (may block on the connect, bounded by its timeout)."""
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return self._open()

    def give(self, client: Store) -> None:
        """Hand back a client with no call in flight."""
        with self._lock:
            self._idle.append(client)

    def close(self) -> None:
        """Close the idle clients (end of the job; idempotent)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for c in idle:
            c.close()  # EtcdStore holds HTTP connections
