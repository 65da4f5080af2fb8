"""The clock every long-lived owner reads (monitor, watchdog, supervisor, rounds), injectable.

Production code takes a ``Clock`` (default ``SYSTEM``) instead of calling ``time`` directly, so a
timeout is tested by moving a fake clock (``tests/fake_clock.py``) rather than by waiting.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Clock:
    """Where time comes from: ``monotonic`` for deadlines and durations, ``wall`` for
    timestamps that other processes or the journal compare, ``sleep`` to wait."""

    monotonic: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time
    sleep: Callable[[float], None] = time.sleep


SYSTEM = Clock()  # immutable: the real clocks
