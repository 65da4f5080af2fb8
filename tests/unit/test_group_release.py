"""After a restart, nothing of train() may keep a destroyed process group alive: its sockets
stay open and peers blocked on this rank wait for the group timeout. Two guards, tested here
with plain objects standing in for groups: the frames held by an exception's whole chain are
cleared, and the reaper warns only about a reference that stays past a short grace."""

from __future__ import annotations

import gc
import importlib
import logging
import threading
import time
import weakref
from pathlib import Path

import pytest

from restartable.inprocess.restart.abort import GroupReaper, drop_frames


class _Group:
    """Weak-referenceable stand-in for a process group."""


def test_the_frames_of_a_chained_exception_are_cleared_too() -> None:
    refs: list[weakref.ref[_Group]] = []

    def all_reduce(group: _Group) -> None:  # a frame that ended, kept by its traceback
        refs.append(weakref.ref(group))
        raise OSError("connection closed by peer")

    def train() -> None:
        try:
            all_reduce(_Group())
        except OSError:
            raise RuntimeError("the collective failed") from None

    try:
        train()
    except RuntimeError as e:
        caught = e
    assert caught.__context__ is not None  # suppressed for display, still chained
    drop_frames(caught)
    assert refs[0]() is None


def _release(reaper: GroupReaper, group: _Group) -> None:
    reaper._held.append(group)
    reaper.release()


def test_a_reference_dropped_within_the_grace_is_no_misuse(
    caplog: pytest.LogCaptureFixture,
) -> None:
    reaper = GroupReaper(rank=0, grace_s=2.0)
    group = _Group()
    holder = [group]  # e.g. a background job that ends a moment later
    with caplog.at_level(logging.WARNING, logger="restartable.inprocess.restart.abort"):
        _release(reaper, group)
        del group
        threading.Timer(0.2, holder.clear).start()
        reaper.close(timeout=5.0)
    assert "still referenced" not in caplog.text


def test_a_reference_that_stays_is_reported_once(caplog: pytest.LogCaptureFixture) -> None:
    reaper = GroupReaper(rank=3, grace_s=0.3)
    kept = [_Group(), _Group()]  # e.g. a DDP model kept by an object that outlives train()
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="restartable.inprocess.restart.abort"):
        _release(reaper, kept[0])
        _release(reaper, kept[1])
        reaper.close(timeout=5.0)
    assert time.monotonic() - t0 >= 0.3
    assert caplog.text.count("rank 3: 1 destroyed process group(s) still referenced") == 1


def test_the_warning_names_what_holds_the_group(caplog: pytest.LogCaptureFixture) -> None:
    """One failure in CI should be enough to find the holder: the warning says who it is."""

    class Trainer:
        def __init__(self, group: _Group) -> None:
            self.process_group = group

    reaper = GroupReaper(rank=1, grace_s=0.1)
    group = _Group()
    trainer = Trainer(group)  # outlives train()
    with caplog.at_level(logging.WARNING, logger="restartable.inprocess.restart.abort"):
        _release(reaper, group)
        del group
        reaper.close(timeout=5.0)
    assert "Held by: Trainer (process_group)" in caplog.text
    del trainer


def test_the_warning_never_names_its_own_cell(caplog: pytest.LogCaptureFixture) -> None:
    # Found by a user: "Held by: cell, ..." in every faulty run; the cell was the diagnostic's
    # own comprehension closure over the group.
    class Trainer:
        def __init__(self, group: _Group) -> None:
            self.process_group = group

    reaper = GroupReaper(rank=1, grace_s=0.1)
    group = _Group()
    trainer = Trainer(group)
    with caplog.at_level(logging.WARNING, logger="restartable.inprocess.restart.abort"):
        _release(reaper, group)
        del group
        reaper.close(timeout=5.0)
    held_by = caplog.text.split("Held by: ")[1].strip()
    assert held_by == "Trainer (process_group)", caplog.text
    del trainer


class _Stateful:
    def __init__(self, group: _Group) -> None:
        self.group = group

    def state_dict(self) -> dict[str, object]:
        return {"w": 1.0}

    def load_state_dict(self, sd: dict[str, object]) -> None:
        pass


def _freed_without_gc(use: object) -> bool:
    """Whether a group held only by a Stateful in a state is freed once ``use(state)`` returned,
    with the cyclic GC off (a reference cycle would keep it until the GC happens to run)."""
    gc.disable()
    try:
        group = _Group()
        ref = weakref.ref(group)
        state = {"model": _Stateful(group), "n": [1, 2]}
        del group
        use(state)  # type: ignore[operator]
        del state
        return ref() is None
    finally:
        gc.enable()


def test_the_local_tiers_walk_of_the_state_keeps_no_cycle() -> None:
    # The cause of the 12.5 s restarts of the README-style script (DDP module in the state,
    # manager outside train()): the local tier's recursive walk was a closure cycle that kept
    # the state, and so the destroyed group, until the cyclic GC ran.
    from restartable.checkpoint.local.walk import leaves

    assert _freed_without_gc(lambda state: leaves(state, []))


def test_the_per_rank_keying_keeps_no_cycle() -> None:
    from restartable.checkpoint.per_rank import PerRank, keyed_by_rank

    def use(state: dict[str, object]) -> None:
        state["own"] = PerRank(x=1)
        with keyed_by_rank(state, 1):
            assert state["own"] == {"rank1": {"x": 1}}
        assert isinstance(state["own"], PerRank)

    assert _freed_without_gc(use)


def test_torchs_module_level_default_group_is_released(tmp_path: Path) -> None:
    # Found by a user: torch.distributed.nn.functional (imported by the first DDP) binds
    # group=group.WORLD as a default argument, keeping iteration 0's group alive for good.
    # If this fails on a new torch, see inprocess/restart/torch_defaults.py.
    import torch
    import torch.distributed as dist

    from restartable.inprocess.restart.abort import abort_process_groups

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
    import torch.distributed.nn.functional as F

    # Another test may have imported it first, binding its own group (or None): bind ours.
    F = importlib.reload(F)

    world = dist.group.WORLD
    bound = F.broadcast.__defaults__ == (world,)  # torch's behaviour undone here
    groups = abort_process_groups()
    assert world in groups
    assert F.broadcast.__defaults__ == (None,) and F.all_reduce.__defaults__[-1] is None
    held_by_torch = [
        fn for fn in vars(F).values() if world in (getattr(fn, "__defaults__", None) or ())
    ]
    assert bound and not held_by_torch
