"""PreemptionHandler: the signal becomes a flag, never an exit; bad input is refused."""

from __future__ import annotations

import os
import signal

import pytest

from inprocess.preemption import PREEMPTED_EXIT_CODE, PreemptionHandler


def test_signal_sets_flag_and_time_left() -> None:
    with PreemptionHandler(exit_signal=signal.SIGUSR1, preempt_time=30.0) as h:
        assert not h.received and h.seconds_left() is None and not h.should_stop()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert h.received and h.should_stop()
        left = h.seconds_left()
        assert left is not None and 29.0 < left <= 30.0


def test_close_restores_previous_handler() -> None:
    seen: list[int] = []
    previous = signal.signal(signal.SIGUSR2, lambda s, f: seen.append(s))
    try:
        h = PreemptionHandler(exit_signal=signal.SIGUSR2)
        h.close()
        h.close()  # idempotent
        os.kill(os.getpid(), signal.SIGUSR2)
        assert seen == [signal.SIGUSR2]
    finally:
        signal.signal(signal.SIGUSR2, previous)


def test_bad_preempt_time_names_field() -> None:
    with pytest.raises(ValueError, match=r"preempt_time \(0\) must be > 0"):
        PreemptionHandler(preempt_time=0)


def test_exit_code_is_tempfail() -> None:
    assert PREEMPTED_EXIT_CODE == 75
