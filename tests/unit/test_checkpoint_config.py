"""Bad inputs to CheckpointManager fail at construction or call, naming the field."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from restartable.checkpoint import (
    CheckpointConfigError,
    CheckpointError,
    CheckpointManager,
    CheckpointStorageError,
    LocalConfig,
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


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"every": 0}, "local_every"),
        ({"every": 1.5}, "local_every"),
        ({"every": True}, "local_every"),
        ({"dir": ""}, "local_dir"),
        ({"dir": 3}, "local_dir"),
        ({"replication_factor": 0}, "replication_factor"),
        ({"replication_factor": 2.0}, "replication_factor"),
        ({"algo": "fast"}, "local_algo"),
        ({"keep": 0}, "local_keep"),
        ({"keep": None}, "local_keep"),
        ({"overlap_copy": "yes"}, "overlap_copy"),
    ],
)
def test_bad_local_config_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(CheckpointConfigError, match=field) as err:
        LocalConfig(**kwargs)
    assert repr(next(iter(kwargs.values()))) in str(err.value)  # the value
    assert ": " in str(err.value)  # then the fix


def test_local_config_defaults_and_immutability(tmp_path: Path) -> None:
    cfg = LocalConfig()
    assert (cfg.every, cfg.dir, cfg.replication_factor, cfg.algo, cfg.keep) == (
        1,
        None,
        1,
        "atomic",
        2,
    )
    assert LocalConfig(dir=tmp_path).dir == tmp_path  # os.PathLike is accepted
    with pytest.raises(TypeError):
        LocalConfig(1)  # type: ignore[misc]  # keyword-only
    with pytest.raises(AttributeError):
        cfg.every = 2  # type: ignore[misc]  # frozen


def test_manager_takes_a_local_config(tmp_path: Path) -> None:
    local = LocalConfig(every=2, dir=str(tmp_path / "local"), keep=1)
    (tmp_path / "local").mkdir()
    state = {"w": torch.zeros(4)}
    with CheckpointManager(str(tmp_path / "p"), persistent_every=100, local=local) as mgr:
        for step in (1, 2, 3):
            state["w"].fill_(float(step))
            mgr.save(step, state)
        mgr.wait()
        state["w"].zero_()
        assert mgr.load_latest(state) == 2  # local every 2 steps; persistent never here
        assert mgr.last_restore is not None and mgr.last_restore.tier == "memory"
        assert torch.equal(state["w"], torch.full((4,), 2.0))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"local_every": 1},
        {"local_dir": "/tmp"},
        {"replication_factor": 2},
        {"local_algo": "fully_parallel"},
        {"local_keep": 3},
    ],
)
def test_local_config_and_local_keywords_together_are_refused(tmp_path: Path, kwargs: dict) -> None:
    name = next(iter(kwargs))
    with pytest.raises(CheckpointConfigError, match=f"local .*{name}.* one place"):
        CheckpointManager(str(tmp_path), local=LocalConfig(), **kwargs)
    assert list(tmp_path.iterdir()) == []


def test_local_must_be_a_local_config(tmp_path: Path) -> None:
    with pytest.raises(CheckpointConfigError, match="LocalConfig"):
        CheckpointManager(str(tmp_path), local={"every": 1})  # type: ignore[arg-type]
