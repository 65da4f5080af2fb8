"""The one fake clock of the unit tests: time moves only when a test moves it.

A ``FakeClock`` is a ``Callable[[], float]`` (what the code under test takes as ``clock=`` /
``cpu_clock=``), and ``clock()`` gives an ``inprocess.clock.Clock`` whose monotonic and wall
readings are this fake time and whose ``sleep`` advances it instead of blocking.
"""

from __future__ import annotations

from restartable.inprocess.clock import Clock


class FakeClock:
    """Fake seconds, starting at ``start``; ``advance`` (or a ``sleep`` through ``clock()``)
    moves them. Not thread-safe beyond a float assignment: tests move it from one thread."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def clock(self) -> Clock:
        return Clock(monotonic=self, wall=self, sleep=self.advance)
