"""Automatic progress detection of the main thread (for the soft timeout)."""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Iterator

from restartable.inprocess.clock import SYSTEM, Clock

# int (*)(void *): the signature Py_AddPendingCall expects; it must return 0 (anything else is
# an error). The callback is libc's ``sigfillset(sigset_t *)``: C code that returns 0 and fills
# our zeroed buffer with ones, so a non-zero buffer means "the probe ran". A Python callback
# would run bytecode, and a restart exception delivered while it runs would be swallowed
# ("Exception ignored on calling ctypes callback"), which happens whenever the main thread
# returns from a blocking collective with both a pending call and the restart queued.
_PENDING_FUNC = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
_DRAIN_S = 1.0  # close(): how long the main thread waits for its scheduled callback to run


class ProgressTracker:
    """Knows when the main thread last ran Python bytecode (or called ``ping()``).

    The monitor thread calls ``poke()`` every check interval: when the previous probe ran, it
    counts as progress seen now, and a new probe is scheduled with ``Py_AddPendingCall``, which
    the interpreter runs in the main thread the next time that thread executes bytecode. A main
    thread blocked in a C call with the GIL released (sleep, I/O, a collective) runs no bytecode,
    so the probe stays pending and ``stalled_for()`` grows. Resolution: one check interval.
    ``paused()`` marks the framework's own waits, which must not count as a stall.

    Create and ``close()`` it in the main thread (close waits for a scheduled probe, so the
    C call never writes into freed memory).
    """

    def __init__(self, *, clock: Clock = SYSTEM) -> None:
        self._clock = clock
        self._last = clock.monotonic()
        self._scheduled = False
        self._paused = 0
        self._lock = threading.Lock()
        self._flag = (ctypes.c_uint64 * 16)()  # sizeof(sigset_t) is 128 bytes in glibc
        self._probe = ctypes.cast(ctypes.CDLL(None).sigfillset, _PENDING_FUNC)
        self._closed = False

    def stamp(self) -> None:
        """Record progress now (``ctx.ping()``)."""
        self._last = self._clock.monotonic()

    def poke(self) -> None:
        """Collect the previous probe and schedule the next one (monitor thread)."""
        with self._lock:
            if self._closed:
                return
            if self._scheduled:
                if self._flag[0] == 0:
                    return  # still pending: the main thread ran no bytecode since
                self._scheduled = False
                self._last = self._clock.monotonic()
            ctypes.memset(self._flag, 0, ctypes.sizeof(self._flag))
            ptr = ctypes.c_void_p(ctypes.addressof(self._flag))
            if ctypes.pythonapi.Py_AddPendingCall(self._probe, ptr) == 0:
                self._scheduled = True

    def stalled_for(self) -> float:
        """Seconds since the last progress seen; 0 while paused."""
        if self._paused:
            return 0.0
        return max(0.0, self._clock.monotonic() - self._last)

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
        """Stop probing; let a scheduled probe run first (main thread; idempotent)."""
        with self._lock:
            self._closed = True
        deadline = self._clock.monotonic() + _DRAIN_S
        # Executing bytecode lets the interpreter run the pending call.
        while self._scheduled and self._flag[0] == 0 and self._clock.monotonic() < deadline:
            pass
        if self._scheduled and self._flag[0] == 0:
            # Never ran: keep the buffer alive for the process's lifetime.
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(self._flag))
