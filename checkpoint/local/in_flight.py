"""The local tier's one background job in flight: a save's copy to file and replicas, and the
store agreement it runs; waited for with a bound, abandoned after a restart."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from restartable.checkpoint.exchange import StoreExchange
from restartable.checkpoint.local.peers import GroupSource
from restartable.checkpoint.worker import BackgroundWorker

# The tier's channel: these lines were the tier's, and printed logs show the logger name.
log = logging.getLogger("restartable.checkpoint.local.tier")


class InFlight:
    """At most one background job of a ``LocalTier`` (its worker runs them one at a time).

    Training thread only: ``LocalTier.save`` sets ``agreement`` and calls ``submit``; its
    ``wait`` and its settling before each collective entry point call ``abandon_if_stale`` then
    ``wait``. ``wait`` blocks up to 2 x timeout.
    """

    def __init__(self, worker: BackgroundWorker, *, timeout: float) -> None:
        self._worker = worker
        self._timeout = timeout
        self._future: Future[None] | None = None
        self.agreement: StoreExchange | None = None  # of the background work in flight

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` on the tier's worker thread: the job in flight from now on."""
        self._future = self._worker.submit(fn, *args)

    def abandon_if_stale(self, group: GroupSource) -> None:
        """After an in-process restart the default group changed; the dedicated group of the
        work in flight is dropped, which closes its sockets and releases a transfer blocked on a
        peer that is gone (instead of waiting for the group's timeout). That step stays
        incomplete; the steps before it are untouched."""
        if self._future is not None and group.is_stale():
            if not self._future.done():
                log.warning("process group changed with a local save in flight: abandoning it")
            if self.agreement is not None:
                self.agreement.abandon()
            group.drop()

    def wait(self) -> None:
        """Wait (bounded: 2 x timeout) for the job in flight, logging how it ended.

        The work stays "in flight" until it ended: a restart that interrupts this wait must
        still find it in ``abandon_if_stale`` and abandon it, or it would stay blocked on a lost
        peer.
        """
        fut = self._future
        if fut is None:
            return
        try:
            fut.result(timeout=2 * self._timeout)
        except FutureTimeout:
            log.error(
                "local save background work did not finish within %.0f s: its step will "
                "not be restored from this tier",
                2 * self._timeout,
            )
            if self.agreement is not None:
                self.agreement.abandon()
        except Exception:
            log.warning("local save background work failed", exc_info=True)
        self._future = None
