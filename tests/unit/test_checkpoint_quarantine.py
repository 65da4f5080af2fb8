"""Quarantine of the checkpoints a finding of silent data corruption distrusts, in one process
(checkpoint.quarantine; tests/dist/test_sdc_quarantine.py runs real ranks and a requeue)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from restartable.checkpoint import CheckpointManager
from restartable.checkpoint.errors import CheckpointConfigError
from restartable.checkpoint.local.holdings import Holdings
from restartable.checkpoint.local.restore import Shard

FINDING = {"rank": 1, "host": "h", "step": 5, "verdict": "transient", "detected_at": 7}


class Counter:
    def __init__(self) -> None:
        self.value = 0

    def state_dict(self) -> dict[str, Any]:
        return {"value": torch.tensor(self.value)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.value = int(sd["value"])


def _mgr(tmp: Path, **kw: Any) -> CheckpointManager:
    local = tmp / "local"
    local.mkdir(exist_ok=True)
    return CheckpointManager(
        str(tmp / "ckpt"), persistent_every=1, keep=10, local_every=1, local_dir=local, **kw
    )


def _state() -> tuple[dict[str, Any], Counter, torch.Tensor]:
    counter, w = Counter(), torch.zeros(4)
    return {"w": w, "step": counter}, counter, w


def _train(mgr: CheckpointManager, state: dict[str, Any], steps: range) -> None:
    for step in steps:
        state["w"].fill_(float(step))
        state["step"].value = step
        mgr.save(step, state)
    mgr.wait()


def _record(tmp: Path) -> tuple[Path, dict[str, Any]]:
    (where,) = (tmp / "ckpt" / "quarantine").iterdir()
    return where, json.loads((where / "finding.json").read_text())


def test_load_after_the_finding_restores_the_verified_step_and_moves_the_rest(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state, counter, w = _state()
    with _mgr(tmp_path) as mgr:
        _train(mgr, state, range(1, 8))
        mgr.quarantine_after(5, finding={**FINDING, "rollback_to": 5})
        with caplog.at_level(logging.WARNING, logger="restartable.checkpoint"):
            assert mgr.load_latest(state) == 5
            assert counter.value == 5 and float(w[0]) == 5.0
            # A later fault before any save: still the verified step (memory tier forgot 6, 7).
            assert mgr.load_latest(state) == 5
        assert [c.step for c in mgr.committed()] == [1, 2, 3, 4, 5]
        where, record = _record(tmp_path)
        moved = sorted(p.name[:15] for p in where.glob("step_*"))
        assert moved == ["step_0000000006", "step_0000000007"]
        assert record["applied"] is True and record["after"] == 5
        assert record["finding"]["detected_at"] == 7 and len(record["moved"]) == 2
        local = list((tmp_path / "local" / "quarantine" / where.name).glob("shard-*.bin"))
        assert local, "the node-local files of steps 6 and 7 moved, not deleted"
        text = caplog.text
        for step in (6, 7):
            assert f"quarantined step {step} of the persistent tier: {where}/step_" in text
            assert f"quarantined step {step} of the memory tier" in text
        assert "silent data corruption on rank 1 at step 5, found at step 7" in text
        # The rolled-back run saves steps 6 and 7 again: new checkpoints, restored as usual.
        _train(mgr, state, range(6, 8))
        assert mgr.load_latest(state) == 7
    state2, counter2, _ = _state()
    with _mgr(tmp_path) as again:  # a requeue: the re-trained step, never the quarantined one
        assert again.load_latest(state2) == 7 and counter2.value == 7
    assert sorted(p.name[:15] for p in where.glob("step_*")) == moved  # evidence kept


def test_a_job_that_dies_before_its_restart_quarantines_at_the_next_load(tmp_path: Path) -> None:
    state, _, _ = _state()
    with _mgr(tmp_path) as mgr:
        _train(mgr, state, range(1, 8))
        mgr.quarantine_after(4, finding=FINDING)
    _, record = _record(tmp_path)
    assert record["applied"] is False and record["after"] == 4
    state2, counter2, w2 = _state()
    with _mgr(tmp_path) as requeued:  # its memory is empty: the old process's files are gone
        assert requeued.load_latest(state2) == 4 and counter2.value == 4 and float(w2[0]) == 4
        assert [c.step for c in requeued.committed()] == [1, 2, 3, 4]
    where, record = _record(tmp_path)
    assert record["applied"] is True
    assert sorted(int(p.name[5:15]) for p in where.glob("step_*")) == [5, 6, 7]


def test_a_save_in_flight_at_the_finding_never_becomes_restorable(tmp_path: Path) -> None:
    state, _, _ = _state()
    with _mgr(tmp_path) as mgr:
        _train(mgr, state, range(1, 4))
        state["w"].fill_(4.0)
        state["step"].value = 4
        mgr.save(4, state)  # its write and commit are in the background
        mgr.quarantine_after(3, finding=FINDING)
        assert mgr.load_latest(state) == 3  # refused at its commit, or committed and moved
        assert [c.step for c in mgr.committed()] == [1, 2, 3]
        _train(mgr, state, range(4, 5))  # the refusal is lifted: the re-trained 4 commits
        assert [c.step for c in mgr.committed()] == [1, 2, 3, 4]


def test_a_users_directory_under_quarantine_is_left_alone(tmp_path: Path) -> None:
    state, _, _ = _state()
    (tmp_path / "ckpt" / "quarantine" / "mine").mkdir(parents=True)
    with _mgr(tmp_path) as mgr:
        _train(mgr, state, range(1, 3))
        assert mgr.load_latest(state) == 2
    assert list((tmp_path / "ckpt" / "quarantine" / "mine").iterdir()) == []


def test_a_bad_step_names_the_field(tmp_path: Path) -> None:
    with _mgr(tmp_path) as mgr, pytest.raises(CheckpointConfigError, match="step"):
        mgr.quarantine_after(-1)


def test_holdings_forget_after_frees_own_copies_and_replicas() -> None:
    hold = Holdings(keep=2)
    for step in (5, 6):  # the two newest unconfirmed steps: both held
        hold.add_own(Shard(step, 0, 2, 8, None, torch.zeros(8, dtype=torch.uint8), None))
        hold.add_replica(Shard(step, 1, 2, 8, None, torch.zeros(8, dtype=torch.uint8), None))
    assert hold.forget_after(5) == [(6, 0), (6, 1)]
    assert sorted(hold.held) == [(5, 0), (5, 1)]
    assert not hold.stale(6, 2)  # nothing newer left for the next save of step 6 to free


def test_a_remote_root_copies_then_removes(tmp_path: Path) -> None:
    """fsspec roots (here memory://) have no atomic rename: copy into quarantine/, then delete
    the original, commit marker first."""
    import uuid

    import fsspec

    root = f"memory://quarantine-test-{uuid.uuid4().hex[:8]}"
    state = {"w": torch.zeros(3)}
    with CheckpointManager(root, persistent_every=1, keep=10) as mgr:
        for step in range(1, 6):
            state["w"].fill_(float(step))
            mgr.save(step, state)
        mgr.wait()
        mgr.quarantine_after(3, finding={"step": 3, "detected_at": 5})
        assert mgr.load_latest(state) == 3 and float(state["w"][0]) == 3.0
        assert [c.step for c in mgr.committed()] == [1, 2, 3]
    fs = fsspec.filesystem("memory")
    markers = fs.glob(root.replace("memory://", "/") + "/quarantine/*/step_*/_COMMITTED.json")
    assert sorted(m.split("/")[-2][:15] for m in markers) == ["step_0000000004", "step_0000000005"]


def _meta(step: int, owner: int) -> tuple[Any, torch.Tensor]:
    from restartable.checkpoint.local import directory, integrity

    buf = torch.full((64,), step, dtype=torch.uint8)
    return directory.ShardMeta(step, owner, 2, 64, integrity.of(buf, 64)), buf


def test_a_file_whose_writer_is_alive_stays_but_behind_the_fence(tmp_path: Path) -> None:
    """A retired rank still on its way out holds its files' locks: they cannot be moved. A
    later scan (a fresh reserve's) skips their distrusted steps; a rewrite after the fence (the
    rolled-back run's save of the same step) is read again."""
    import time

    from restartable.checkpoint.local import directory, fence

    alive = directory.ShardFiles(tmp_path)  # the other, still living, process's files
    mine = directory.ShardFiles(tmp_path)
    for step in (4, 6):
        alive.write(*_meta(step, 1))
        mine.write(*_meta(step, 0))
    dest = tmp_path / "quarantine" / "sdc-x"
    fence.write(dest, 4)
    moved = mine.quarantine(4, dest)
    assert [s for s, _ in moved] == [6] and (dest / moved[0][1].name).is_file()
    assert sorted((m.step, m.owner) for m in directory.scan(tmp_path)) == [(4, 0), (4, 1)]
    time.sleep(0.05)  # past the file system's timestamp granularity
    alive.write(*_meta(6, 1))  # rewritten after the fence: the rolled-back run's step 6
    assert (6, 1) in {(m.step, m.owner) for m in directory.scan(tmp_path)}
    alive.close()
    mine.close()


def test_a_failed_move_is_logged_and_the_load_still_skips_the_distrusted_steps(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "quarantine").write_text("in the way")  # no directory there
    state, counter, _ = _state()
    mgr = _mgr(tmp_path)
    try:
        _train(mgr, state, range(1, 6))
        mgr.quarantine_after(3, finding=FINDING)
        with caplog.at_level(logging.ERROR, logger="restartable.checkpoint"):
            assert mgr.load_latest(state) == 3 and counter.value == 3
    finally:
        mgr.close()
    assert "quarantining the steps after 3 failed" in caplog.text
