"""The console line of a restart (inprocess.restart.story)."""

from __future__ import annotations

import logging

import pytest

from inprocess import journal
from inprocess.context import RestartRecord
from inprocess.restart.story import RestartStory, line

REC = RestartRecord(
    iteration=2,
    cause="exception on rank 1",
    faulting_ranks=(1,),
    phases={},
    active_before=(0, 1),
    active_after=(2, 1),
    reserve_after=(),
)


def test_the_line_says_cause_ranks_step_tier_and_seconds() -> None:
    assert line(REC, restore=(30, "memory"), seconds=0.214) == (
        "restart 2: exception on rank 1; ranks 0,1 -> 2,1 (reserve: -); resumed step 30 from "
        "the memory tier 0.21 s after the fault"
    )
    assert "no checkpoint to resume from" in line(REC, restore=(None, None), seconds=1.0)
    assert "no CheckpointManager restore" in line(REC, restore=None, seconds=1.0)


def test_a_restore_completes_the_line_and_steps_pay_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Found by a user: no console line announced a restart or where it resumed from.
    story = RestartStory()
    channel = logging.getLogger(journal.CHANNEL)
    with caplog.at_level(logging.INFO, logger="inprocess.restart.story"):
        story.restarted(REC, fault_time=0.0)
        channel.debug("save", extra={"journal": {"step": 31}})  # not a restore: ignored
        channel.debug("restore", extra={"journal": {"step": 30, "tier": "memory"}})
        story.end_iteration()  # already said: nothing more
    lines = [r.getMessage() for r in caplog.records if r.name == "inprocess.restart.story"]
    assert len(lines) == 1 and "resumed step 30 from the memory tier" in lines[0]
    assert not channel.handlers  # no longer listening once said
    story.close()


def test_without_a_manager_the_line_comes_at_the_first_step(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Found by a user: a script with no CheckpointManager saw its restart's line only when the
    # iteration ended (at the end of training, for a run without another fault).
    story = RestartStory()
    with caplog.at_level(logging.INFO, logger="inprocess.restart.story"):
        story.restarted(REC, fault_time=0.0)
        journal.record("step", step=7)  # what ctx.ping(7) writes
        journal.record("step", step=8)
        story.end_iteration()
    lines = [r.getMessage() for r in caplog.records if r.name == "inprocess.restart.story"]
    assert len(lines) == 1 and "no CheckpointManager restore; first step 7" in lines[0], lines
    assert not logging.getLogger(journal.CHANNEL).handlers
    story.close()


def test_without_any_logging_the_line_goes_to_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers.clear()
    try:
        story = RestartStory()
        story.restarted(REC, fault_time=0.0)
        story.end_iteration()
        story.close()
    finally:
        root.handlers[:] = saved
    assert "restart 2: exception on rank 1" in capsys.readouterr().err
