"""The node-local directory's files: records written last, cleared on release, swept only when
their process is gone (checkpoint.local.directory)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from restartable.checkpoint.local import directory, integrity, packing, walk

ROOT = Path(__file__).resolve().parents[2]


def _meta(step: int, owner: int, buf: torch.Tensor) -> directory.ShardMeta:
    return directory.ShardMeta(step, owner, 1, buf.numel(), integrity.of(buf, buf.numel()))


def _buf(v: int) -> torch.Tensor:
    """A packed shard of {"w": 2500 floats of v}, as LocalTier.save packs one."""
    tensors = walk.leaves({"w": torch.full((2500,), float(v))}, [])
    layout = packing.ShardLayout.of(tensors)
    header = packing.header_bytes(layout, {}, {"step": v})
    buf = torch.zeros(packing.packed_size(layout, header), dtype=torch.uint8)  # padding too
    return buf[: packing.pack_into(buf, layout, header, [x.value for x in tensors])]


def _steps(root: Path) -> list[tuple[int, int]]:
    return sorted((m.step, m.owner) for m in directory.scan(root))


def test_a_released_step_is_gone_at_once_and_its_file_is_reused(tmp_path: Path) -> None:
    files = directory.ShardFiles(tmp_path)
    files.write(_meta(1, 0, _buf(1)), _buf(1))
    files.write(_meta(1, 1, _buf(2)), _buf(2))  # a replica of rank 1
    assert _steps(tmp_path) == [(1, 0), (1, 1)]
    names = set(os.listdir(tmp_path))
    files.release(lambda s: s >= 2)
    assert _steps(tmp_path) == []  # cleared records: a scan no longer offers them
    files.write(_meta(2, 0, _buf(3)), _buf(3))
    assert set(os.listdir(tmp_path)) == names  # no new file
    (meta,) = directory.scan(tmp_path)
    got = directory.read(meta)
    assert got is not None and torch.equal(got[0], _buf(3))
    files.close()
    assert os.listdir(tmp_path) == [Path(meta.path).name]  # the empty file went, the shard stays
    assert stat.S_IMODE(os.stat(meta.path).st_mode) == 0o600  # the user's data


def test_a_save_interrupted_before_its_record_leaves_no_shard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = directory.ShardFiles(tmp_path)
    files.write(_meta(1, 0, _buf(1)), _buf(1))
    files.release(lambda s: s >= 2)

    def killed(*args: object, **kwargs: object) -> bytes:
        raise OSError("killed between the data and the record")

    monkeypatch.setattr(directory, "encode_record", killed)
    with pytest.raises(OSError):
        files.write(_meta(2, 0, _buf(2)), _buf(2))
    assert _steps(tmp_path) == []  # neither the old step (released) nor the half-written one
    monkeypatch.undo()
    files.write(_meta(3, 0, _buf(3)), _buf(3))  # the file is reused after the failure
    assert _steps(tmp_path) == [(3, 0)] and len(os.listdir(tmp_path)) == 1
    files.close()


def test_torn_record_and_rewritten_file_are_not_read(tmp_path: Path) -> None:
    files = directory.ShardFiles(tmp_path)
    files.write(_meta(1, 0, _buf(1)), _buf(1))
    (old,) = directory.scan(tmp_path)
    # Rewritten since the scan (a co-located writer reused the file): the stale record is
    # refused before a byte of data is trusted.
    files.release(lambda s: s >= 2)
    files.write(_meta(2, 0, _buf(1)), _buf(1))
    assert directory.read(old) is None
    # A record torn halfway (only its first half written) is no record.
    rec = directory.encode_record(_meta(3, 0, _buf(1)))
    with open(old.path, "r+b") as f:
        f.write(rec[: len(rec) // 2])
    assert directory.scan(tmp_path) == []
    files.close()


_WRITER = textwrap.dedent(
    """
    import os, sys, torch
    from pathlib import Path
    from restartable.checkpoint.local import directory, integrity
    root, step, mode = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    buf = torch.full((1000,), step, dtype=torch.uint8)
    files = directory.ShardFiles(root)
    files.write(directory.ShardMeta(step, 5, 1, 1000, integrity.of(buf, 1000)), buf)
    print("written", flush=True)
    if mode == "die":
        os._exit(0)  # no close(): as a killed process
    sys.stdin.read()  # alive, holding its files, until the test closes stdin
    """
)


def _writer(root: Path, step: int, mode: str) -> subprocess.Popen[str]:
    p = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(root), str(step), mode],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None and p.stdout.readline() == "written\n"
    return p


def test_sweep_removes_unkept_files_of_ended_processes_only(tmp_path: Path) -> None:
    for step in (1, 7):
        dead = _writer(tmp_path, step, "die")
        assert dead.wait(timeout=60) == 0
    alive = _writer(tmp_path, 2, "live")
    try:
        mine = directory.ShardFiles(tmp_path)
        mine.write(_meta(3, 0, _buf(3)), _buf(3))
        assert _steps(tmp_path) == [(1, 5), (2, 5), (3, 0), (7, 5)]
        # Step 7 is kept (newer than what is pruned); step 1 is not and its process is gone;
        # step 2 is not kept either, but its writer is alive and owns it; our own file is ours.
        assert mine.sweep(lambda s: s >= 5) == 1
        assert _steps(tmp_path) == [(2, 5), (3, 0), (7, 5)]
    finally:
        assert alive.stdin is not None
        alive.stdin.close()
        alive.wait(timeout=60)
    assert mine.sweep(lambda s: s >= 5) == 1  # its process ended: now it goes
    assert _steps(tmp_path) == [(3, 0), (7, 5)]
    mine.close()
