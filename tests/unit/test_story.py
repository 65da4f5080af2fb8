"""The console line of a restart (inprocess.restart.story)."""

from __future__ import annotations

import logging

import pytest

from restartable.inprocess import journal
from restartable.inprocess.context import RestartRecord
from restartable.inprocess.restart.story import RestartStory, line

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
    with caplog.at_level(logging.INFO, logger="restartable.inprocess.restart.story"):
        story.restarted(REC, fault_time=0.0)
        channel.debug("save", extra={"journal": {"step": 31}})  # not a restore: ignored
        channel.debug("restore", extra={"journal": {"step": 30, "tier": "memory"}})
        story.end_iteration()  # already said: nothing more
    lines = [
        r.getMessage() for r in caplog.records if r.name == "restartable.inprocess.restart.story"
    ]
    assert len(lines) == 1 and "resumed step 30 from the memory tier" in lines[0]
    assert not channel.handlers  # no longer listening once said
    story.close()


def test_without_a_manager_the_line_comes_at_the_first_step(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Found by a user: a script with no CheckpointManager saw its restart's line only when the
    # iteration ended (at the end of training, for a run without another fault).
    story = RestartStory()
    with caplog.at_level(logging.INFO, logger="restartable.inprocess.restart.story"):
        story.restarted(REC, fault_time=0.0)
        journal.record("step", step=7)  # what ctx.ping(7) writes
        journal.record("step", step=8)
        story.end_iteration()
    lines = [
        r.getMessage() for r in caplog.records if r.name == "restartable.inprocess.restart.story"
    ]
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


def test_the_line_names_the_tier_each_rank_restored_from(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Found by a user: "resumed step 16 from the memory tier" after a SIGKILL, where the reserve
    # that replaced the killed rank restored from the node-local copy (memory cannot survive a
    # kill); the line said only what rank 0 saw.
    import torch.distributed as dist

    from restartable.inprocess.protocol.store import as_store
    from restartable.inprocess.restart.restored import TierBoard

    store = as_store(dist.HashStore())

    def board(me: int) -> TierBoard:
        return TierBoard(store, lambda: store, iteration=2, me=me, active=(2, 1))

    board(1).publish("memory", 30)  # the survivor, on its own thread in a real job
    story = RestartStory()
    with caplog.at_level(logging.INFO, logger="restartable.inprocess.restart.story"):
        story.restarted(REC, fault_time=0.0, lead=True, board=board(2))
        logging.getLogger(journal.CHANNEL).debug(
            "restore", extra={"journal": {"step": 30, "tier": "local_dir"}}
        )
        story.close()  # waits for the line
    lines = [
        r.getMessage() for r in caplog.records if r.name == "restartable.inprocess.restart.story"
    ]
    assert len(lines) == 1, lines
    assert "resumed step 30: memory on 1 rank, node-local on 1 rank (the reserve) " in lines[0]


def test_the_tiers_phrase_groups_ranks_and_names_reserves() -> None:
    from restartable.inprocess.restart.restored import phrase

    assert phrase({0: "memory", 1: "memory", 3: "peer"}, newcomers={3}) == (
        "memory on 2 ranks, a peer's copy on 1 rank (the reserve)"
    )
    assert phrase({0: "persistent", 4: "persistent"}, newcomers={4}) == (
        "persistent on 2 ranks (1 of them a reserve)"
    )


def test_the_tier_board_waits_for_missing_ranks_on_its_clock_only() -> None:
    # The loop's clock bounds the gather: on a fake clock the 2 s bound passes without waiting.
    import time

    import torch.distributed as dist

    from restartable.inprocess.protocol.store import as_store
    from restartable.inprocess.restart.restored import TierBoard
    from tests.fake_clock import FakeClock

    store, fake = as_store(dist.HashStore()), FakeClock()
    board = TierBoard(store, lambda: store, iteration=2, me=1, active=(2, 1), clock=fake.clock())
    board.publish("memory", 30)  # rank 2 never publishes
    t0, start = time.monotonic(), fake.now
    assert board.gather() == {1: "memory"}
    assert fake.now - start > 2.0 and time.monotonic() - t0 < 1.0
