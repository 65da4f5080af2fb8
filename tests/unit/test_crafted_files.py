"""Files the framework reads are data, not code: crafted ones are refused and run nothing."""

from __future__ import annotations

import base64
import io
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from restartable.checkpoint.errors import CheckpointError
from restartable.checkpoint.lightning import _load_lightning_part
from restartable.checkpoint.local import packing, unpacking, walk
from restartable.rerun import persist
from restartable.rerun.errors import RerunConfigError


class _Payload:
    """Creates ``path`` when unpickled."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (self.path, "w"))


def _torch_saved(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _shard(objects: dict[str, Any]) -> torch.Tensor:
    layout = packing.ShardLayout.of([])
    header = packing.header_bytes(layout, objects, {"step": 1})
    buf = torch.empty(packing.packed_size(layout, header), dtype=torch.uint8)
    packing.pack_into(buf, layout, header, [])
    return buf


@pytest.mark.parametrize("tag", ["__restartable_pickled__", "__restartable_saved__"])
def test_a_crafted_local_tier_header_is_refused(tmp_path: Path, tag: str) -> None:
    marker = tmp_path / "pwned"
    blob = pickle.dumps(_Payload(marker)) if "pickled" in tag else _torch_saved(_Payload(marker))
    buf = _shard({"x": {tag: base64.b64encode(blob).decode()}})
    target: dict[str, Any] = {"x": b""}
    if "pickled" in tag:  # the old form is plain JSON now: handed back as a dict, never run
        unpacking.unpack_into(buf, target)
        assert isinstance(target["x"], dict)
    else:
        with pytest.raises(CheckpointError, match=r"not plain data.*refused unread"):
            unpacking.unpack_into(buf, target)
    assert not marker.exists()


def test_an_object_the_loader_would_refuse_is_refused_at_save_time(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"state entry 'cfg' .*_Payload"):
        walk.leaves({"cfg": _Payload(tmp_path / "x")}, [])
    assert not (tmp_path / "x").exists()


def test_a_crafted_rerun_state_is_refused(tmp_path: Path) -> None:
    from restartable.rerun import RerunStateMachine

    sd = RerunStateMachine(mode="validate_results").state_dict()
    sd["rng"] = _torch_saved(_Payload(tmp_path / "rng"))
    with pytest.raises(RerunConfigError, match=r"state_dict\['rng'\].*not plain data"):
        persist.decode(sd)
    sd["rng"], sd["data"] = b"", _torch_saved([[_Payload(tmp_path / "data")]])
    with pytest.raises(RerunConfigError, match=r"state_dict\['data'\]"):
        persist.decode(sd)
    assert list(tmp_path.iterdir()) == []


def test_a_crafted_lightning_part_is_refused(tmp_path: Path) -> None:
    data = _torch_saved({"epoch": 1, "hyper_parameters": _Payload(tmp_path / "pl")})
    with pytest.raises(CheckpointError, match=r"Lightning part.*refused unread"):
        _load_lightning_part(data, weights_only=None)
    assert not (tmp_path / "pl").exists()
    ok = _load_lightning_part(
        _torch_saved({"epoch": 1, "loops": {"x": torch.ones(1)}}), weights_only=None
    )
    assert ok["epoch"] == 1
