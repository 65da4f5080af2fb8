"""After a restart, nothing of train() may keep a destroyed process group alive: its sockets
stay open and peers blocked on this rank wait for the group timeout. Two guards, tested here
with plain objects standing in for groups: the frames held by an exception's whole chain are
cleared, and the reaper warns only about a reference that stays past a short grace."""

from __future__ import annotations

import logging
import threading
import time
import weakref

import pytest

from inprocess.restart.abort import GroupReaper
from inprocess.restart.active import _drop_frames


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
    _drop_frames(caught)
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
    with caplog.at_level(logging.WARNING, logger="inprocess.restart.abort"):
        _release(reaper, group)
        del group
        threading.Timer(0.2, holder.clear).start()
        reaper.close(timeout=5.0)
    assert "still referenced" not in caplog.text


def test_a_reference_that_stays_is_reported_once(caplog: pytest.LogCaptureFixture) -> None:
    reaper = GroupReaper(rank=3, grace_s=0.3)
    kept = [_Group(), _Group()]  # e.g. a DDP model kept by an object that outlives train()
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="inprocess.restart.abort"):
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
    with caplog.at_level(logging.WARNING, logger="inprocess.restart.abort"):
        _release(reaper, group)
        del group
        reaper.close(timeout=5.0)
    assert "Held by: Trainer (process_group)" in caplog.text
    del trainer
