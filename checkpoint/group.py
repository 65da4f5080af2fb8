"""A dedicated gloo process group for background checkpoint work that follows the default group."""

from __future__ import annotations

import contextlib
import datetime
import logging
import secrets
import threading
import time
import weakref
from typing import TYPE_CHECKING

from restartable.checkpoint import _torch_private
from restartable.checkpoint.errors import CheckpointConfigError, CheckpointError
from restartable.checkpoint.sealing import parse_count

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch.distributed import ProcessGroup

log = logging.getLogger(__name__)

# Arrival polls before a group is created: from 1 ms, doubling up to 50 ms, and at least
# world / _JOB_POLLS_PER_S apart, so that the polls of a job of thousands of ranks stay a bounded
# load on the store server (docs/scale.md).
_ARRIVE_POLL_FIRST_S = 0.001
_ARRIVE_POLL_MAX_S = 0.05
_JOB_POLLS_PER_S = 20_000.0


def _arrive(store: dist.Store, key: str, *, world: int, timeout: float) -> None:
    """Wait, in Python, until every rank of the default group has arrived at ``key``.

    Why: ``new_group`` is a store rendezvous in C++ that blocks for the group's whole timeout
    (the manager's ``timeout``, 600 s by default) when a peer never arrives, and nothing can
    interrupt it. A rank whose peer faulted just before ``load_latest`` then held the restart
    for that long (found by the fault matrix). This loop is Python, so the restart's
    interruption reaches it at once; once everyone has arrived, ``new_group`` is quick.
    """
    store.add(key, 1)
    end = time.monotonic() + timeout
    pause = _ARRIVE_POLL_FIRST_S
    # A read, not add(key, 0): on etcd an add is a compare-and-swap written through raft,
    # which every poll of every rank would cost (measured: 17.7 s of etcd CPU, 64 ranks).
    while (arrived := parse_count(key, store.get(key))) < world:
        if time.monotonic() > end:
            raise CheckpointError(
                f"only {arrived} of {world} ranks reached the checkpoint group set-up within "
                f"{timeout:.0f} s (timeout): a rank stopped or skipped a collective call"
            )
        time.sleep(max(pause, world / _JOB_POLLS_PER_S))
        pause = min(pause * 2, _ARRIVE_POLL_MAX_S)


class BackgroundGroup:
    """Owner of a dedicated gloo group that follows the current default process group.

    Checkpoint collectives must never run on the training group from another thread (two
    threads sharing one group deadlock), and loads need a CPU group even when training uses
    NCCL. This object creates one gloo group over the same ranks as the default group and
    recreates it when the default group changes (after an in-process restart the old default
    group is destroyed and a new one, perhaps with other ranks, exists). Users: ``load_latest``
    on the training thread, and the local tier's replica transfers. The persistent writer never
    uses it; it only takes ``token`` to name its store keys (see checkpoint.exchange).

    ``current()`` is COLLECTIVE whenever it has to (re)create the group: every rank of the
    default group must call it at the same point of the program (save / load entry). Callers
    must make sure no background work still uses the previous group before calling it.
    Thread-safety: calls are serialised by a lock, but the collective contract still holds.
    """

    def __init__(self, *, timeout: float, name: str = "ckpt") -> None:
        if not timeout > 0:
            raise CheckpointConfigError(
                f"timeout ({timeout!r}) must be a positive number of seconds: pass e.g. 600.0"
            )
        self._timeout = float(timeout)
        self._name = name  # names this owner's arrival keys (two owners arrive independently)
        self._built_on_default = 0  # groups created over the current default group
        self._lock = threading.Lock()
        # The default group our group was built for, held WEAKLY: a strong reference would keep a
        # destroyed default group's sockets open after an in-process restart, so peers blocked on
        # this rank would wait for the gloo timeout instead of being released at once. A dead
        # reference reads as None, never as the new group, so a reused id cannot fool us.
        self._default: weakref.ref[ProcessGroup] | None = None
        # Our dedicated group, weakly too: torch's registry keeps it alive while it exists, and
        # destroying the default group (the restart's abort) unregisters it; a strong reference
        # here would keep its sockets open until the next save. Work in flight holds its own.
        self._group: weakref.ref[ProcessGroup] | None = None
        self._generation = 0
        self._token: str | None = None
        self._closed = False

    @property
    def timeout(self) -> float:
        """The timeout (seconds) of every collective on the dedicated group."""
        return self._timeout

    @property
    def generation(self) -> int:
        """Incremented each time a new dedicated group is created (lets callers notice rebinds)."""
        return self._generation

    @property
    def token(self) -> str | None:
        """A random name every rank agreed on when the current group was created (None when
        not distributed): unique per group instance, it namespaces store keys of background
        work so that an attempt from before a restart can never be mistaken for a new one."""
        return self._token

    def current(self) -> ProcessGroup | None:
        """The dedicated group for the current default group; None when not distributed.

        COLLECTIVE over the default group when the default group changed since the last call.
        """
        import torch.distributed as dist

        with self._lock:
            if self._closed:
                raise RuntimeError("BackgroundGroup.current() called after close()")
            if not (dist.is_available() and dist.is_initialized()):
                self._drop_locked()
                return None
            default = dist.group.WORLD
            assert default is not None  # initialized, checked above
            built_for = self._default() if self._default is not None else None
            group = self._group() if self._group is not None else None
            if group is not None and default is built_for:
                return group
            self._drop_locked()
            self._built_on_default = self._built_on_default + 1 if default is built_for else 1
            _arrive(
                _torch_private.default_store(),
                f"restartable/bg/{self._name}/{self._built_on_default}",
                world=dist.get_world_size(),
                timeout=self._timeout,
            )
            group = dist.new_group(
                backend="gloo", timeout=datetime.timedelta(seconds=self._timeout)
            )
            box = [secrets.token_hex(6) if dist.get_rank() == 0 else None]
            dist.broadcast_object_list(box, group_src=0, group=group)
            self._token = box[0]
            self._group = weakref.ref(group)
            self._default = weakref.ref(default)
            self._generation += 1
            log.debug(
                "created dedicated gloo group (generation %d, %d ranks)",
                self._generation,
                dist.get_world_size(),
            )
            return group

    def is_stale(self) -> bool:
        """True when a dedicated group exists but the default group changed (or is gone) since.

        Not collective; lets an owner notice that work in flight on the old group must be
        abandoned before calling ``current()``.
        """
        import torch.distributed as dist

        with self._lock:
            if self._group is None:
                return False
            if not (dist.is_available() and dist.is_initialized()):
                return True
            built_for = self._default() if self._default is not None else None
            return dist.group.WORLD is not built_for

    def drop(self) -> None:
        """Abandon the dedicated group now (not collective). The next ``current()`` recreates it.

        Destroying the group closes its sockets, which releases peers blocked on it once every
        rank has dropped it (or their timeout expires).
        """
        with self._lock:
            self._drop_locked()

    def close(self) -> None:
        """Destroy the dedicated group if it still exists. Idempotent."""
        with self._lock:
            self._drop_locked()
            self._closed = True

    def __enter__(self) -> BackgroundGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _drop_locked(self) -> None:
        ref, self._group, self._default, self._token = self._group, None, None, None
        group = ref() if ref is not None else None
        if group is None:
            return
        import torch.distributed as dist

        # After destroy_process_group() of the default group every subgroup is already gone
        # from the registry; destroying it again would raise.
        if _torch_private.is_live_group(group):
            with contextlib.suppress(Exception):
                dist.destroy_process_group(group)
        else:
            with contextlib.suppress(Exception):
                group.shutdown()
