"""Commit markers, listing and retention of the persistent tier's directory layout."""

from __future__ import annotations

from pathlib import Path

from restartable.checkpoint.persistent.layout import (
    COMMIT_MARKER,
    IN_PROGRESS_MARKER,
    CheckpointDirs,
    dir_name,
    parse_dir_name,
)


def _make(layout: CheckpointDirs, step: int, token: str, *, commit: bool) -> str:
    path = layout.join(dir_name(step, token))
    layout.begin(path, step=step, world_size=1)
    (Path(path) / "__0_0.distcp").write_bytes(b"data")
    if commit:
        layout.commit(path, {"step": step, "files": {}, "committed": float(step)})
    return path


def test_dir_names_round_trip_and_foreign_names_are_ignored() -> None:
    assert parse_dir_name(dir_name(42, "0123abcd")) == 42
    for foreign in ["step_42", "step_0000000042", "step_0000000042-XYZ12345", "latest", "ckpt"]:
        assert parse_dir_name(foreign) is None


def test_only_committed_directories_are_listed(tmp_path: Path) -> None:
    layout = CheckpointDirs(str(tmp_path))
    _make(layout, 1, "aaaaaaaa", commit=True)
    _make(layout, 2, "bbbbbbbb", commit=False)  # crashed mid-write
    torn = _make(layout, 3, "cccccccc", commit=False)
    (Path(torn) / COMMIT_MARKER).write_text('{"format": "restartable.checkp')  # torn marker
    assert [c.step for c in layout.list_committed()] == [1]


def test_retention_keeps_exactly_keep_and_never_touches_foreign_dirs(tmp_path: Path) -> None:
    layout = CheckpointDirs(str(tmp_path))
    for step in range(1, 6):
        _make(layout, step, f"{step:08x}", commit=True)
    (tmp_path / "user_notes").mkdir()
    (tmp_path / "step_0000000001").mkdir()  # looks similar, not ours
    layout.apply_retention(2)
    assert [c.step for c in layout.list_committed()] == [4, 5]
    assert (tmp_path / "user_notes").is_dir()
    assert (tmp_path / "step_0000000001").is_dir()


def test_retention_cleans_only_stale_partials_that_are_provably_ours(tmp_path: Path) -> None:
    layout = CheckpointDirs(str(tmp_path))
    old_partial = _make(layout, 1, "11111111", commit=False)
    unmarked = layout.join(dir_name(1, "22222222"))
    Path(unmarked).mkdir()  # no in-progress marker: not provably ours
    _make(layout, 2, "33333333", commit=True)
    newer_partial = _make(layout, 3, "44444444", commit=False)  # may still be in flight
    layout.apply_retention(3)
    assert not Path(old_partial).exists()
    assert Path(unmarked).is_dir()
    assert Path(newer_partial).is_dir()
    assert [c.step for c in layout.list_committed()] == [2]


def test_remove_deletes_commit_marker_first(tmp_path: Path) -> None:
    layout = CheckpointDirs(str(tmp_path))
    path = _make(layout, 1, "aaaaaaaa", commit=True)
    calls: list[str] = []
    real_rm = layout.fs.rm

    def spy(p: str, recursive: bool = False) -> None:
        calls.append(str(p))
        real_rm(p, recursive=recursive)

    layout.fs.rm = spy  # type: ignore[method-assign]
    layout.remove(path)
    assert calls[0].endswith(COMMIT_MARKER)
    assert not Path(path).exists()


def test_in_progress_marker_written_on_begin(tmp_path: Path) -> None:
    layout = CheckpointDirs(str(tmp_path))
    path = _make(layout, 7, "abcdef01", commit=False)
    assert (Path(path) / IN_PROGRESS_MARKER).is_file()


def test_memory_filesystem_listing_and_retention() -> None:
    layout = CheckpointDirs("memory://layout-test")
    for step in (1, 2, 3):
        path = layout.join(dir_name(step, f"{step:08x}"))
        layout.begin(path, step=step, world_size=1)
        layout.commit(path, {"step": step, "files": {}, "committed": float(step)})
    layout.apply_retention(1)
    assert [c.step for c in layout.list_committed()] == [3]
    layout.fs.rm(layout.path, recursive=True)
