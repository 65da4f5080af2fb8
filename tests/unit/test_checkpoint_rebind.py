"""The manager survives many re-creations of the default process group (in-process restarts)."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from restartable.checkpoint import CheckpointManager


@pytest.fixture
def fresh_world() -> Iterator[None]:
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _init() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_many_restarts_rebind_without_leaks(tmp_path: Path, fresh_world: None) -> None:
    with CheckpointManager(str(tmp_path), persistent_every=1, keep=2) as mgr:
        baseline: tuple[int, int] | None = None
        for restart in range(12):
            _init()
            # Every "train()" call starts by restoring, then saves.
            # A save in flight at the "restart" is either completed or abandoned.
            x = torch.zeros(1 << 16)
            loaded = mgr.load_latest({"x": x})
            assert loaded == mgr.latest_step()
            assert x[0].item() == float(loaded or 0)
            if restart % 2 == 0 and restart >= 2:
                assert loaded is not None and loaded >= restart - 1  # waited saves are kept
            x.fill_(float(restart + 1))
            mgr.save(restart + 1, {"x": x})
            if restart % 2:
                mgr.wait()  # half the restarts happen with a save still in flight
            dist.destroy_process_group()
            if restart == 3:
                baseline = (threading.active_count(), _fds())
        mgr.wait()
        assert baseline is not None
        assert threading.active_count() <= baseline[0]
        assert _fds() <= baseline[1] + 2
        assert mgr.latest_step() == 12
        out = {"x": torch.zeros(1 << 16)}
        assert mgr.load_latest(out) == 12
        assert out["x"][0].item() == 12.0
