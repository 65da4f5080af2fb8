"""A persistent save that was due but never committed is redone at the next save; a cancelled
save that committed anyway says so."""

from __future__ import annotations

import concurrent.futures
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from restartable.checkpoint import CheckpointManager
from restartable.checkpoint.persistent.save import SaveStats


def test_a_restore_newer_than_the_missing_persistent_step_saves_it_next(tmp_path: Path) -> None:
    state = {"w": torch.zeros(4)}
    with CheckpointManager(str(tmp_path), persistent_every=5, local_every=1) as mgr:
        for step in range(1, 8):
            state["w"] += 1
            mgr.save(step, state)
        mgr.wait()
        # As if the fault that restarted the job had cancelled the save of step 5.
        (five,) = mgr.committed()
        shutil.rmtree(five.path)
        assert mgr.load_latest(state) == 7  # the memory copy; the persistent tier has none
        mgr.save(8, state)  # not a multiple of 5: written because step 5 was owed
        mgr.wait()
        assert [c.step for c in mgr.committed()] == [8]
        mgr.save(9, state)  # owed no more: back to the interval
        mgr.wait()
        assert [c.step for c in mgr.committed()] == [8]


def test_nothing_is_owed_while_the_persistent_tier_has_the_due_step(tmp_path: Path) -> None:
    state = {"w": torch.zeros(4)}
    with CheckpointManager(str(tmp_path), persistent_every=5, local_every=1) as mgr:
        for step in range(1, 8):
            mgr.save(step, state)
        mgr.wait()
        assert mgr.load_latest(state) == 7
        mgr.save(8, state)
        mgr.wait()
        assert [c.step for c in mgr.committed()] == [5]


def test_a_cancelled_save_that_committed_says_so_after_the_cancel(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The log said "abandoning the save of step 200" 0.1 s before "saved step 200": the cancel
    # line now promises nothing, and the drain says which way it went.
    with CheckpointManager(str(tmp_path)) as mgr:
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        done.set_result(SaveStats(step=200))
        mgr._persistent._abandoned = done
        with caplog.at_level(logging.INFO, logger="restartable.checkpoint.persistent.save"):
            mgr._persistent.drain_abandoned()
    assert "the cancelled save of step 200 had committed" in caplog.text
