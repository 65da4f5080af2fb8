"""One background thread per tier that a process exit never waits on.

Why not ``concurrent.futures.ThreadPoolExecutor``: its threads are joined by the interpreter at
exit, before any ``atexit`` handler runs. A background save blocked on a peer that is gone (a
store wait bounded only by the save timeout, 600 s by default) then holds a finished process
alive for that long, with nothing logged. This worker's thread is a daemon: the exit waits only
where the owner decides to wait (``CheckpointManager.close``, bounded), and a process that never
closes its manager still exits at once.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
_STOP = object()


class BackgroundWorker:
    """A single daemon thread running submitted calls in order, each with its own ``Future``.

    ``submit`` is called from the owner's thread; ``stop`` ends the thread after the work
    already submitted (joined at most ``timeout`` seconds: it never blocks for longer).
    ``initializer`` runs once on the thread before any work (e.g. lowering its CPU priority).
    """

    def __init__(self, name: str, *, initializer: Callable[[], None] | None = None) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._initializer = initializer
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Queue ``fn(*args)``; its result or exception lands in the returned future."""
        if self._stopped:
            raise RuntimeError(f"{self._thread.name}: submit() after stop()")
        fut: Future[T] = Future()
        self._queue.put((fut, fn, args))
        return fut

    def stop(self, timeout: float) -> bool:
        """Stop after the queued work; True if the thread ended within ``timeout`` seconds."""
        if not self._stopped:
            self._stopped = True
            self._queue.put(_STOP)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning(
                "%s still busy after %.1f s; leaving it (daemon)", self._thread.name, timeout
            )
            return False
        return True

    def _loop(self) -> None:
        if self._initializer is not None:
            self._initializer()
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # delivered to the owner through the future
                fut.set_exception(e)
            del item, fut, fn, args  # drop references to the job's buffers before waiting again
