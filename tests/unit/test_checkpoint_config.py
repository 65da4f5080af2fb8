"""Bad inputs to CheckpointManager fail at construction or call, naming the field."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from checkpoint import (
    CheckpointConfigError,
    CheckpointError,
    CheckpointManager,
    CheckpointStorageError,
)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"persistent_every": 0}, "persistent_every"),
        ({"persistent_every": 1.5}, "persistent_every"),
        ({"keep": 0}, "keep"),
        ({"keep": True}, "keep"),
        ({"timeout": -1.0}, "timeout"),
        ({"on_busy": "drop"}, "on_busy"),
        ({"local_every": 0}, "local_every"),
    ],
)
def test_bad_settings_name_the_field(tmp_path: Path, kwargs: dict, field: str) -> None:
    with pytest.raises(CheckpointConfigError, match=field):
        CheckpointManager(str(tmp_path), **kwargs)
    assert list(tmp_path.iterdir()) == []


def test_empty_root_is_rejected() -> None:
    with pytest.raises(CheckpointConfigError, match="root"):
        CheckpointManager("")


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_unwritable_root_fails_at_construction(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    with pytest.raises(CheckpointStorageError, match="not writable"):
        CheckpointManager(str(ro / "ckpts"))


def test_root_that_is_a_file_fails_at_construction(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(CheckpointStorageError, match="not writable"):
        CheckpointManager(str(f))
    assert f.read_text() == "x"


def test_bad_save_arguments(tmp_path: Path) -> None:
    with CheckpointManager(str(tmp_path), persistent_every=1) as mgr:
        with pytest.raises(CheckpointConfigError, match="step"):
            mgr.save(-1, {"x": torch.zeros(1)})
        with pytest.raises(CheckpointConfigError, match="state"):
            mgr.save(1, [torch.zeros(1)])  # type: ignore[arg-type]
        assert mgr.committed() == []


def test_use_after_close_is_an_error(tmp_path: Path) -> None:
    mgr = CheckpointManager(str(tmp_path), persistent_every=1)
    mgr.close()
    mgr.close()  # idempotent
    with pytest.raises(CheckpointError, match="after close"):
        mgr.save(1, {"x": torch.zeros(1)})
