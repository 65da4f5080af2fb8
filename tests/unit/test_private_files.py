"""What the framework writes is private to the user; what another user planted is refused."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from restartable.checkpoint import CheckpointManager
from restartable.checkpoint.errors import CheckpointStorageError
from restartable.checkpoint.local import directory
from restartable.inprocess import journal
from restartable.inprocess.watchdog import kill_notice

STRANGER = 54321  # a uid nobody on the test machine uses


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_checkpoints_of_both_tiers_are_private(tmp_path: Path) -> None:
    local = tmp_path / "local"
    local.mkdir()
    with CheckpointManager(str(tmp_path / "p"), persistent_every=1, local_every=1,
                           local_dir=str(local)) as mgr:  # fmt: skip
        mgr.save(1, {"w": torch.ones(4)})
        mgr.wait()
    shards = list(local.glob("shard-*"))
    assert shards and {_mode(f) for f in shards} == {0o600}
    (attempt,) = (tmp_path / "p").glob("step_*")
    assert _mode(attempt) == 0o700
    assert _mode(attempt / "_COMMITTED.json") == 0o600


def test_journal_is_private(tmp_path: Path) -> None:
    jr = journal.open_journal(tmp_path / "j", rank=0)
    try:
        assert _mode(tmp_path / "j") == 0o700
        assert _mode(jr.path) == 0o600
    finally:
        jr.close()


@pytest.mark.skipif(os.getuid() != 0, reason="giving a directory to another uid needs root")
def test_a_local_dir_of_another_user_is_refused(tmp_path: Path) -> None:
    theirs = tmp_path / "shm-job"
    theirs.mkdir(mode=0o777)
    os.chown(theirs, STRANGER, STRANGER)
    with pytest.raises(CheckpointStorageError, match=f"belongs to uid {STRANGER}"):
        CheckpointManager(str(tmp_path / "p"), local_every=1, local_dir=str(theirs))


@pytest.mark.skipif(os.getuid() != 0, reason="giving a directory to another uid needs root")
def test_a_planted_kill_notice_is_not_believed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    planted = tmp_path / f"restartable-{os.getuid()}"
    planted.mkdir(mode=0o777)
    (planted / f"hard-timeout-{os.getpid()}").write_bytes(b"")
    os.chown(planted, STRANGER, STRANGER)
    assert not kill_notice.posted(os.getpid())  # a real SIGTERM is not ignored
    os.chown(planted, os.getuid(), os.getgid())
    planted.chmod(0o700)
    kill_notice.post(os.getpid())
    assert kill_notice.posted(os.getpid())
    kill_notice.clear(os.getpid())


@pytest.mark.parametrize("step", [10**9, 10**10 + 7, 2**63 - 1])
def test_any_int64_step_is_seen_by_both_tiers(tmp_path: Path, step: int) -> None:
    local = tmp_path / "local"
    local.mkdir()
    kw = {"persistent_every": 1, "local_every": 1, "local_dir": str(local), "local_keep": 1}
    with CheckpointManager(str(tmp_path / "p"), **kw) as mgr:  # type: ignore[arg-type]
        mgr.save(step - 1, {"w": torch.zeros(4)})
        mgr.save(step, {"w": torch.full((4,), 2.0)})
        mgr.wait()
        assert mgr.latest_step() == step
    assert [m.step for m in directory.scan(local)] == [step]  # the older step was pruned
    with CheckpointManager(str(tmp_path / "p"), **kw) as mgr:  # type: ignore[arg-type]
        state = {"w": torch.zeros(4)}
        assert mgr.load_latest(state) == step
        assert float(state["w"][0]) == 2.0
