"""PreemptionHandler: the signal becomes a flag, never an exit; bad input is refused; a preempted
job finishes its step and exits with the status job scripts requeue on."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from restartable.inprocess.preemption import PreemptionHandler
from restartable.inprocess.watchdog import kill_notice
from tests.multiproc import run_job


def test_signal_sets_flag_and_time_left() -> None:
    with PreemptionHandler(exit_signal=signal.SIGUSR1, preempt_time=30.0) as h:
        assert not h.received and h.seconds_left() is None and not h.should_stop()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert h.received and h.should_stop()
        left = h.seconds_left()
        assert left is not None and 29.0 < left <= 30.0


def test_the_watchdogs_hard_timeout_sigterm_is_not_a_preemption() -> None:
    # A rank ended by its watchdog must not stop the whole job as if it were preempted (found by
    # the fault matrix: hang_gil in an interruptible call ended the job with status 75).
    with PreemptionHandler(exit_signal=signal.SIGUSR1) as h:
        kill_notice.post(os.getpid())
        try:
            os.kill(os.getpid(), signal.SIGUSR1)
            assert not h.received
        finally:
            kill_notice.clear(os.getpid())
        os.kill(os.getpid(), signal.SIGUSR1)
        assert h.received


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


# The loop of the module's docstring, with step 2 lasting until the signal has arrived (the
# test sends it once step 2 started), so the signal always lands inside a step.
_PREEMPTED_RANK = """
import signal, sys, time
from restartable.inprocess.preemption import PREEMPTED_EXIT_CODE, PreemptionHandler

with PreemptionHandler(exit_signal=signal.SIGTERM, preempt_time=30.0) as preempt:
    for step in range(5):
        print(f"step {step} started", flush=True)
        deadline = time.monotonic() + 30.0
        while step == 2 and not preempt.received and time.monotonic() < deadline:
            time.sleep(0.01)
        print(f"step {step} finished", flush=True)
        if preempt.should_stop():
            print(f"checkpoint of step {step + 1} written", flush=True)
            sys.exit(PREEMPTED_EXIT_CODE)
"""


def test_sigterm_finishes_the_step_and_the_rank_exits_75(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(_PREEMPTED_RANK)
    job = run_job([str(script)], deadline=60, signal_when=("step 2 started", signal.SIGTERM))
    # 75 (EX_TEMPFAIL) is the documented status job scripts requeue on (README, Slurm section;
    # inprocess.launch passes it through). Without the handler the signal kills: -SIGTERM.
    assert job.returncode == 75, job.output
    assert "step 2 finished" in job.output  # the step in progress was not cut short
    assert "checkpoint of step 3 written" in job.output
    assert "step 3 started" not in job.output  # and no further step began
