"""The pipe between a rank and its watchdog process (stdlib only: both sides import it).

Rank -> watchdog (the process's stdin): one line per heartbeat holding the rank's current
iteration, prefixed with ``RESERVE_PREFIX`` while the rank waits as a reserve, or
``CLOSE_MESSAGE``. Watchdog -> rank (its stdout): ``READY_MESSAGE`` once, when watching.
"""

from __future__ import annotations

CLOSE_MESSAGE = b"close\n"
READY_MESSAGE = b"ready\n"
RESERVE_PREFIX = b"r"


def beat_line(iteration: int, *, reserve: bool) -> bytes:
    """The heartbeat line the rank writes for ``iteration``."""
    return f"{RESERVE_PREFIX.decode() if reserve else ''}{iteration}\n".encode()


def parse_beat(line: bytes) -> tuple[int, bool]:
    """``(iteration, reserve)`` of one heartbeat line (without its newline); raises
    ``ValueError`` for a line that is not a beat."""
    reserve = line.startswith(RESERVE_PREFIX)
    return int(line[len(RESERVE_PREFIX) :] if reserve else line), reserve
