"""Automatic progress detection of the main thread (for the soft timeout)."""

from __future__ import annotations

import contextlib
import ctypes
import threading
import time
from collections.abc import Callable, Iterator

# int (*)(void *): the signature Py_AddPendingCall expects.
_PENDING_FUNC = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
_DRAIN_S = 1.0  # close(): how long the main thread waits for its scheduled callback to run


class ProgressTracker:
    """Knows when the main thread last ran Python bytecode (or called ``ping()``).

    The monitor thread calls ``poke()`` periodically: it schedules a pending call
    (``Py_AddPendingCall``) that the interpreter runs in the main thread the next time that
    thread executes bytecode; the call stamps the clock. A main thread blocked in a C call with
    the GIL released (sleep, I/O, a collective) runs no bytecode, so its stamp goes stale.
    ``paused()`` marks the framework's own waits, which must not count as a stall.

    Create it and ``close()`` it in the main thread (close waits for a scheduled callback, so
    the C callback never outlives this object).
    """

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._last = clock()
        self._scheduled = False
        self._paused = 0
        self._lock = threading.Lock()
        self._callback = _PENDING_FUNC(self._on_pending)
        self._closed = False

    def _on_pending(self, _arg: int | None) -> int:
        self._scheduled = False
        self._last = self._clock()
        return 0

    def stamp(self) -> None:
        """Record progress now (``ctx.ping()``)."""
        self._last = self._clock()

    def poke(self) -> None:
        """Schedule one stamp in the main thread unless one is already pending (any thread)."""
        with self._lock:
            if self._scheduled or self._closed:
                return
            if ctypes.pythonapi.Py_AddPendingCall(self._callback, None) == 0:
                self._scheduled = True

    def stalled_for(self) -> float:
        """Seconds since the last progress; 0 while paused."""
        if self._paused:
            return 0.0
        return max(0.0, self._clock() - self._last)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """A framework wait: no stall is counted inside; progress is stamped on exit."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1
            self.stamp()

    def close(self) -> None:
        """Stop scheduling; let a scheduled callback run first (main thread; idempotent)."""
        with self._lock:
            self._closed = True
        deadline = time.monotonic() + _DRAIN_S
        # Executing bytecode lets the interpreter run the pending call.
        while self._scheduled and time.monotonic() < deadline:
            pass
        if self._scheduled:  # never ran: keep the C callback alive for the process's lifetime
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(self._callback))
