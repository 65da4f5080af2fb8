"""BackgroundGroup: a dedicated gloo group that follows the default process group."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from restartable.checkpoint import BackgroundGroup, CheckpointConfigError


def test_none_without_torch_distributed() -> None:
    with BackgroundGroup(timeout=5.0) as bg:
        assert bg.current() is None
        assert not bg.is_stale()


def test_bad_timeout_is_rejected() -> None:
    with pytest.raises(CheckpointConfigError, match="timeout"):
        BackgroundGroup(timeout=0)


def test_follows_the_default_group_across_reinitialisation() -> None:
    bg = BackgroundGroup(timeout=5.0)
    try:
        groups = []
        for _ in range(3):
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            g = bg.current()
            assert g is not None and g is not dist.group.WORLD
            assert bg.current() is g  # same default group: same dedicated group
            t = torch.ones(1)
            dist.all_reduce(t, group=g)
            groups.append(g)
            dist.destroy_process_group()
            assert bg.is_stale()
        assert len({id(g) for g in groups}) == 3
        assert bg.generation == 3
    finally:
        bg.close()
        bg.close()  # idempotent
    with pytest.raises(RuntimeError, match="after close"):
        bg.current()


def test_a_destroyed_default_group_is_not_kept_alive() -> None:
    # After an in-process restart the old default group must really go away: while any object
    # holds it, its sockets stay open and peers blocked on this rank wait for the gloo timeout.
    import gc
    import weakref

    bg = BackgroundGroup(timeout=5.0)
    try:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        dedicated = weakref.ref(bg.current())
        default = weakref.ref(dist.distributed_c10d._get_default_group())
        dist.destroy_process_group()
        gc.collect()
        assert default() is None
        assert dedicated() is None  # its sockets are closed now, not at the next save
        assert bg.is_stale()
    finally:
        bg.close()
