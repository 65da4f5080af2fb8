"""Another user's directory, or one others may write, is refused before a byte is written in it.

A real second user (``tests/stranger.py``) plants symbolic links, at the very names the job
would open, to a file of ours that the stranger could not write itself (issue 46, finding 5:
the job appended 52 journal lines through such links). Each directory the framework writes in
is refused with one line naming it, and the file behind the link keeps its bytes.
"""

from __future__ import annotations

import os
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from restartable.checkpoint import CheckpointManager
from restartable.checkpoint.errors import CheckpointStorageError
from restartable.checkpoint.private_files import NotPrivateError, open_private, replace_private
from restartable.inprocess import journal
from restartable.inprocess.faults import record
from restartable.inprocess.timeouts.state_file import read_state
from restartable.rerun.errors import RerunConfigError
from restartable.rerun.tracker import ResultTracker
from tests.stranger import as_stranger, stranger, stranger_dir

SECRET = b"the user's own data\n"


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A 0600 file of ours in a 0700 directory: the stranger can neither read nor write it."""
    path = tmp_path / "victim"
    path.write_bytes(SECRET)
    path.chmod(0o600)
    return path


@pytest.fixture(params=["foreign", "world-writable"])
def planted(request: pytest.FixtureRequest) -> Iterator[tuple[Path, str]]:
    """(a directory the stranger can plant in, the words the refusal must hold): one the
    stranger owns, or one of ours that others may write (0777)."""
    path = stranger_dir("planted-")
    if request.param == "world-writable":
        os.chown(path, os.getuid(), os.getgid())
        path.chmod(0o777)
        reason = "has mode 777: group or others may write it"
    else:
        reason = f"belongs to uid {stranger()[0]}, not to this user"
    try:
        yield path, reason
    finally:
        shutil.rmtree(path)


def _plant(link: Path, target: Path) -> None:
    as_stranger("ln", "-s", str(target), str(link))
    assert link.is_symlink() and link.lstat().st_uid == stranger()[0]


def test_a_journal_dir_with_planted_links_is_refused(
    planted: tuple[Path, str], victim: Path
) -> None:
    where, reason = planted
    _plant(where / f"rank0-{socket.gethostname()}-{os.getpid()}.jsonl", victim)
    with pytest.raises(ValueError, match=f"journal_dir \\('{where}'\\) {reason}") as info:
        journal.open_journal(where, rank=0)
    assert "\n" not in str(info.value)
    assert victim.read_bytes() == SECRET


def test_a_local_dir_with_planted_links_is_refused(
    planted: tuple[Path, str], victim: Path, tmp_path: Path
) -> None:
    where, reason = planted
    _plant(where / f".restartable-probe.{os.getpid()}", victim)
    with pytest.raises(CheckpointStorageError, match=f"local_dir \\('{where}'\\) {reason}"):
        CheckpointManager(str(tmp_path / "p"), local_every=1, local_dir=str(where))
    assert victim.read_bytes() == SECRET


def test_a_checkpoint_root_with_planted_links_is_refused(
    planted: tuple[Path, str], victim: Path
) -> None:
    where, reason = planted
    _plant(where / "step_0000000001-0badf00d", victim.parent)
    with pytest.raises(CheckpointStorageError, match=f"checkpoint root \\('{where}'\\) {reason}"):
        CheckpointManager(str(where), persistent_every=1)
    assert victim.read_bytes() == SECRET
    assert sorted(p.name for p in victim.parent.iterdir()) == ["victim"]


def test_a_directory_given_as_a_strangers_link_is_refused(tmp_path: Path) -> None:
    theirs = stranger_dir("links-")
    try:
        ours = tmp_path / "journal"
        ours.mkdir(mode=0o700)
        _plant(theirs / "journal", ours)  # points at a private directory of ours
        with pytest.raises(ValueError, match=f"symbolic link that uid {stranger()[0]} made"):
            journal.open_journal(theirs / "journal", rank=0)
        assert list(ours.iterdir()) == []
    finally:
        shutil.rmtree(theirs)


def test_no_file_is_written_through_a_link_even_in_a_private_directory(
    tmp_path: Path, victim: Path
) -> None:
    """Belt and braces: a link in a directory of ours (our own mistake, not an attack) is
    still not followed by the journal, a checkpoint's files or an atomic replace."""
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    (mine / f"rank0-{socket.gethostname()}-{os.getpid()}.jsonl").symlink_to(victim)
    with pytest.raises(ValueError, match="is a symbolic link: refused to write through it"):
        journal.open_journal(mine, rank=0)
    (mine / "__0_0.distcp").symlink_to(victim)
    with pytest.raises(NotPrivateError, match="symbolic link"):
        open_private(mine / "__0_0.distcp", os.O_WRONLY, exclusive=True)
    (mine / "flag").symlink_to(victim)
    replace_private(mine / "flag", b"new")  # replaces the link itself, not its target
    assert not (mine / "flag").is_symlink() and (mine / "flag").read_bytes() == b"new"
    assert victim.read_bytes() == SECRET


def test_a_private_directory_of_ours_is_accepted(tmp_path: Path) -> None:
    local = tmp_path / "local"
    with CheckpointManager(
        str(tmp_path / "p"), persistent_every=1, local_every=1, local_dir=str(local)
    ) as mgr:
        mgr.save(1, {"w": torch.ones(2)})
        mgr.wait()
    assert {p.stat().st_mode & 0o777 for p in (local, tmp_path / "p")} == {0o700}


def test_a_timeouts_state_file_another_user_could_write_is_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``ft_state.json`` decides when a rank counts as hung: a planted one (a step timeout of
    a year would hide every hang of a section) is ignored with a WARNING naming it."""
    body = '{"version": 1, "timeouts": {"step": 31536000.0}, "safety_factor": 5.0}'
    theirs = stranger_dir("ftstate-")
    try:
        as_stranger("sh", "-c", f"umask 077; printf '%s' '{body}' > {theirs}/ft_state.json")
        assert read_state(theirs / "ft_state.json") == {}
        assert f"belongs to uid {stranger()[0]}" in caplog.text
        shared = tmp_path / "shared"  # ours, but others may write it (no sticky bit)
        shared.mkdir()
        shared.chmod(0o777)
        (shared / "ft_state.json").write_text(body)
        assert read_state(shared / "ft_state.json") == {}
        assert "group or others may write its directory (mode 777)" in caplog.text
        shared.chmod(0o700)
        assert read_state(shared / "ft_state.json") == {"step": 31536000.0}  # ours: believed
    finally:
        shutil.rmtree(theirs)


def test_a_run_directory_of_another_user_holds_no_fault_record(
    planted: tuple[Path, str], victim: Path
) -> None:
    where, reason = planted
    _plant(where / "fired.jsonl", victim)
    with pytest.raises(PermissionError, match=f"fault record directory \\('{where}'\\) {reason}"):
        record.claim(where, "kill@rank1:step3")
    assert victim.read_bytes() == SECRET


def test_the_rerun_tracker_never_appends_through_a_link(tmp_path: Path, victim: Path) -> None:
    link = tmp_path / "rejected.jsonl"
    link.symlink_to(victim)
    with pytest.raises(RerunConfigError, match="must be a file this process can append to"):
        ResultTracker(link)
    made = ResultTracker(tmp_path / "new.jsonl")
    assert (tmp_path / "new.jsonl").stat().st_mode & 0o777 == 0o600 and made.path.exists()
    assert victim.read_bytes() == SECRET
