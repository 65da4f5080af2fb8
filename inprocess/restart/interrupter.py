"""Delivering a restart into the main thread: ``Interrupter``, shared by the monitor and
``ctx.atomic()``.

Created by ``inprocess.restart.startup`` on the main thread, once per process; ``deliver`` is
called from the monitor threads, everything else from the main thread (see the class).
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

from restartable.inprocess.errors import RestartInterrupt
from restartable.inprocess.restart.thread_stack import in_import

# Signal sent to the main thread with each interrupt: a blocking syscall (time.sleep, I/O) is
# retried after a signal unless the handler raises (PEP 475), so ours raises the restart.
WAKE_SIGNAL = signal.SIGUSR2


class Interrupter:
    """Delivers ``RestartInterrupt`` into the main thread; shared by monitor and ``ctx.atomic()``.

    ``lock`` is held by ``ctx.atomic()`` sections and by every delivery, so a delivery never
    lands inside an atomic section. Created in the main thread; ``close()`` restores the signal
    handler. ``arm()`` before ``train()``, ``disarm()`` once it returned or raised: after
    ``disarm()`` nothing is delivered and a pending exception is cleared.
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._tid = threading.get_ident()
        self._armed = False
        self._pending = False
        self.acked = threading.Event()
        self._old_handler: Any = None
        self._installed = threading.current_thread() is threading.main_thread()
        if self._installed:
            self._old_handler = signal.signal(WAKE_SIGNAL, self._on_signal)

    @property
    def thread_id(self) -> int:
        """The thread that restarts are delivered to (the main thread)."""
        return self._tid

    @property
    def pending(self) -> bool:
        """A restart was delivered and not yet acknowledged."""
        return self._pending

    def arm(self) -> None:
        """Allow deliveries (main thread, before ``train()``)."""
        with self.lock:
            self._armed, self._pending = True, False
            self.acked.clear()

    def deliver(self) -> bool | None:
        """Raise the restart in the main thread (monitor thread).

        True: delivered. False: disarmed (``train()`` already ended). None: deferred because the
        main thread is inside an import; the caller retries shortly.
        """
        with self.lock:
            if not self._armed:
                return False
            if in_import(self._tid):
                return None
            self._pending = True
            ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(self._tid), ctypes.py_object(RestartInterrupt)
            )
            if self._installed:
                with contextlib.suppress(OSError):  # the main thread is exiting
                    signal.pthread_kill(self._tid, WAKE_SIGNAL)
            return True

    def disarm(self) -> bool:
        """Stop deliveries and clear a pending one (main thread); True if one was delivered.

        May itself be hit by a delivery made just before it took the lock; callers loop.
        """
        with self.lock:
            was = self._pending
            self._armed = self._pending = False
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._tid), None)
            self.acked.set()
            return was

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._pending and self._armed:
            raise RestartInterrupt("restart requested (wake-up signal)")

    def close(self) -> None:
        """Disarm and restore the previous signal handler (main thread; idempotent)."""
        with contextlib.suppress(RestartInterrupt):
            self.disarm()
        if self._installed:
            self._installed = False
            signal.signal(WAKE_SIGNAL, self._old_handler)

    @contextlib.contextmanager
    def atomic(self) -> Iterator[None]:
        """A block no restart interrupts half-way; one pending restart fires before it starts."""
        with self.lock:
            if self._pending:
                raise RestartInterrupt("restart requested before an atomic section")
            yield


def disarm(interrupter: Interrupter) -> bool:
    """Stop ``interrupter``'s deliveries (main thread, once ``train()`` or a reserve's prewarm
    ended); a delivery racing with this call is absorbed."""
    while True:
        try:
            return interrupter.disarm()
        except RestartInterrupt:
            continue
