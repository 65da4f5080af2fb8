"""A persistent checkpoint someone else wrote runs no code, even with its checksums fixed up.

Whoever can write a checkpoint directory can also rewrite ``_COMMITTED.json`` (its CRC32s are
not keyed), so these tests fix the marker up to match the crafted files: only the way the files
are read stands between them and the loading ranks.
"""

from __future__ import annotations

import json
import logging
import pickle
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata

from restartable.checkpoint import CheckpointManager
from restartable.checkpoint.errors import CheckpointCorruptError
from restartable.checkpoint.persistent.safe_reader import UnsafeCheckpointError, load_metadata
from tests.payload import Payload


def _fix_up_marker(ckpt: Path) -> None:
    """Rewrite ``_COMMITTED.json`` so every file's CRC32 and size match what is on disk now."""
    marker = ckpt / "_COMMITTED.json"
    body = json.loads(marker.read_text())
    for f in ckpt.iterdir():
        if not f.name.startswith("_"):
            data = f.read_bytes()
            body["files"][f.name] = {"crc32": zlib.crc32(data), "size": len(data)}
    marker.write_text(json.dumps(body))


def _save_two(root: Path) -> list[Path]:
    with CheckpointManager(str(root), persistent_every=1, keep=2) as mgr:
        mgr.save(1, {"w": torch.full((4,), 1.0), "n": 1})
        mgr.save(2, {"w": torch.full((4,), 2.0), "n": 2})
        mgr.wait()
    return sorted(root.glob("step_*"))


def _crafted_metadata(real: bytes, marker: Path) -> bytes:
    """DCP's real metadata with a payload riding in it: a plain ``pickle.load`` returns a valid
    ``Metadata`` (the load would go on) and has created ``marker`` on the way."""
    metadata = pickle.loads(real)
    metadata.planner_data = {"x": Payload(marker)}
    return pickle.dumps(metadata)


def test_a_crafted_metadata_runs_no_code_and_the_load_falls_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    marker = tmp_path / "pwned"
    _, newest = _save_two(tmp_path / "ckpt")
    crafted = _crafted_metadata((newest / ".metadata").read_bytes(), marker)
    (newest / ".metadata").write_bytes(crafted)
    _fix_up_marker(newest)

    state: dict[str, Any] = {"w": torch.zeros(4), "n": 0}
    with caplog.at_level(logging.WARNING), CheckpointManager(str(tmp_path / "ckpt")) as mgr:
        assert mgr.load_latest(state) == 1
    assert not marker.exists()
    assert float(state["w"][0]) == 1.0 and state["n"] == 1
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"{newest / '.metadata'}: not a DCP metadata file of plain data" in warning
    assert "io.open is not allowed" in warning
    assert isinstance(pickle.loads(crafted), Metadata) and marker.exists()  # the attack is real


def test_a_crafted_metadata_without_fallback_stops_with_one_line_naming_it(
    tmp_path: Path,
) -> None:
    marker = tmp_path / "pwned"
    _, newest = _save_two(tmp_path / "ckpt")
    (newest / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    _fix_up_marker(newest)
    mgr = CheckpointManager(str(tmp_path / "ckpt"), fallback_on_corruption=False)
    with mgr, pytest.raises(UnsafeCheckpointError) as info:
        mgr.load_latest({"w": torch.zeros(4), "n": 0})
    assert "\n" not in str(info.value)
    assert str(info.value).startswith(f"{newest / '.metadata'}: ")
    assert not marker.exists()


def test_crafted_metadata_in_every_checkpoint_stops_with_one_line(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    for ckpt in _save_two(tmp_path / "ckpt"):
        (ckpt / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
        _fix_up_marker(ckpt)
    mgr = CheckpointManager(str(tmp_path / "ckpt"))
    with mgr, pytest.raises(CheckpointCorruptError, match="every committed checkpoint") as info:
        mgr.load_latest({"w": torch.zeros(4), "n": 0})
    assert "\n" not in str(info.value) and ".metadata" in str(info.value)
    assert not marker.exists()


def test_a_crafted_value_in_a_data_file_runs_no_code(tmp_path: Path) -> None:
    """A checkpoint written by plain ``dcp.save`` with an object that runs code when
    ``torch.load(weights_only=False)`` (DCP's own ``load_bytes``) reads it back."""
    marker = tmp_path / "pwned"
    _, newest = _save_two(tmp_path / "ckpt")
    for f in newest.iterdir():
        if not f.name.startswith("_"):
            f.unlink()
    dcp.save({"w": torch.full((4,), 9.0), "n": Payload(marker)}, checkpoint_id=str(newest))
    _fix_up_marker(newest)
    state: dict[str, Any] = {"w": torch.zeros(4), "n": 0}
    with CheckpointManager(str(tmp_path / "ckpt")) as mgr:
        assert mgr.load_latest(state) == 1
    assert not marker.exists()
    assert float(state["w"][0]) == 1.0 and state["n"] == 1
    dcp.load({"w": torch.zeros(4), "n": 0}, checkpoint_id=str(newest), no_dist=True)
    assert marker.exists()  # the attack is real: DCP's own loader runs it


@pytest.mark.parametrize("name", ["../../etc/passwd", "/etc/passwd", ".."])
def test_metadata_naming_a_data_file_outside_its_directory_is_refused(
    tmp_path: Path, name: str
) -> None:
    (ckpt,) = _save_two(tmp_path / "ckpt")[1:]
    metadata = pickle.loads((ckpt / ".metadata").read_bytes())
    for info in metadata.storage_data.values():
        info.relative_path = name
    with pytest.raises(UnsafeCheckpointError, match="outside its directory"):
        load_metadata(pickle.dumps(metadata), str(ckpt / ".metadata"))


def test_plain_dcp_load_still_reads_our_checkpoints(tmp_path: Path) -> None:
    _, newest = _save_two(tmp_path / "ckpt")
    state: dict[str, Any] = {"w": torch.zeros(4), "n": 0}
    dcp.load(state, checkpoint_id=str(newest), no_dist=True)
    assert float(state["w"][0]) == 2.0 and state["n"] == 2
    assert isinstance(load_metadata((newest / ".metadata").read_bytes(), "m"), Metadata)


def test_a_crafted_metadata_on_an_fsspec_root_runs_no_code(tmp_path: Path) -> None:
    """The same through DCP's fsspec reader (object stores: ``s3://``, here ``memory://``)."""
    import fsspec

    marker = tmp_path / "pwned"
    root = f"memory://crafted-{id(marker)}"
    with CheckpointManager(root, persistent_every=1, keep=2) as mgr:
        mgr.save(1, {"w": torch.full((4,), 1.0)})
        mgr.save(2, {"w": torch.full((4,), 2.0)})
        mgr.wait()
        newest = mgr.committed()[-1].path
    fs = fsspec.filesystem("memory")
    crafted = _crafted_metadata(fs.cat_file(f"{newest}/.metadata"), marker)
    fs.pipe_file(f"{newest}/.metadata", crafted)
    body = json.loads(fs.cat_file(f"{newest}/_COMMITTED.json"))
    body["files"][".metadata"] = {"crc32": zlib.crc32(crafted), "size": len(crafted)}
    fs.pipe_file(f"{newest}/_COMMITTED.json", json.dumps(body).encode())
    state: dict[str, Any] = {"w": torch.zeros(4)}
    with CheckpointManager(root) as mgr:
        assert mgr.load_latest(state) == 1
    assert not marker.exists() and float(state["w"][0]) == 1.0
