"""The rank process as its watchdog sees it: death notification, signals, the kill sequence.

Used by the watchdog process only (``inprocess.watchdog.process``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
from collections.abc import Sequence
from typing import Protocol

from restartable.inprocess.clock import SYSTEM, Clock
from restartable.inprocess.watchdog import kill_notice

log = logging.getLogger("restartable.inprocess.watchdog.process")  # the process's one log channel

KILL_WAIT_S = 30.0  # how long a SIGKILLed rank may take to disappear before we give up waiting
_DEAD_POLL_S = 0.01  # only where pidfd_open is missing (not Linux >= 5.3)


class Rank(Protocol):
    """What the kill sequence needs of the watched rank process (``WatchedRank``; a test's
    fake process)."""

    @property
    def pid(self) -> int: ...

    def signal(self, sig: int) -> None: ...

    def wait_gone(self, timeout: float) -> bool: ...


class WatchedRank:
    """The rank process: death notification through a pidfd, signals without pid reuse.

    Where ``pidfd_open`` is missing, death is polled (``kill(pid, 0)``) every ``_DEAD_POLL_S``
    on ``clock``; the pidfd waits block in ``select`` for at most the timeout given.
    """

    def __init__(self, pid: int, *, clock: Clock = SYSTEM) -> None:
        self.pid = pid
        self._clock = clock
        self._pidfd: int | None = None
        self._gone_early = False
        try:
            self._pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._gone_early = True  # died before we could watch it: report at once
        except (AttributeError, OSError):
            self._pidfd = None  # no pidfd here: EOF on stdin remains the death signal

    @property
    def fds(self) -> list[int]:
        """What to ``select`` on for the rank's death (empty without a pidfd)."""
        return [] if self._pidfd is None else [self._pidfd]

    def gone(self, readable: Sequence[int] = ()) -> bool:
        """Whether the rank process has ended (``readable``: what ``select`` returned)."""
        if self._gone_early:
            return True
        if self._pidfd is not None:
            return self._pidfd in readable or _poll_fd(self._pidfd, 0.0)
        return not _alive(self.pid)

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the rank (nothing when it is gone)."""
        with contextlib.suppress(ProcessLookupError):
            if self._pidfd is not None:
                signal.pidfd_send_signal(self._pidfd, sig)
            else:
                os.kill(self.pid, sig)

    def wait_gone(self, timeout: float) -> bool:
        """Wait at most ``timeout`` s for the rank to end; whether it did."""
        if self._pidfd is not None:
            return self._gone_early or _poll_fd(self._pidfd, timeout)
        end = self._clock.monotonic() + timeout
        while self._clock.monotonic() < end:
            if not _alive(self.pid):
                return True
            self._clock.sleep(_DEAD_POLL_S)
        return not _alive(self.pid)


def terminate(rank: Rank, grace: float) -> str:
    """SIGCONT + SIGTERM, ``grace`` seconds, then SIGKILL; says which one ended ``rank``.

    The hard-timeout notice (``kill_notice``) is posted first, so the rank's preemption handler
    does not take this SIGTERM for the scheduler's, and cleared once the rank is gone.
    """
    log.warning("rank pid %d missed its heartbeat: SIGTERM", rank.pid)
    kill_notice.post(rank.pid)  # not a preemption notice: see inprocess.watchdog.kill_notice
    try:
        rank.signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
        rank.signal(signal.SIGTERM)
        if rank.wait_gone(grace):
            return "ended by SIGTERM"
        log.warning("rank pid %d still alive %.1f s after SIGTERM: SIGKILL", rank.pid, grace)
        rank.signal(signal.SIGKILL)
        if rank.wait_gone(KILL_WAIT_S):
            return f"ended by SIGKILL after {grace} s grace"
        return "still present after SIGKILL (uninterruptible sleep?)"
    finally:
        kill_notice.clear(rank.pid)


def _poll_fd(fd: int, timeout: float) -> bool:
    readable, _, _ = select.select([fd], [], [], timeout)
    return bool(readable)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
