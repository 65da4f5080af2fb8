"""Tear down this rank's process groups so that peers blocked on it are released at once: destroy
them, clear the frames of ``train()`` that hold them, and drop them off the main thread."""

from __future__ import annotations

import gc
import logging
import queue
import threading
import traceback
import types
import weakref
from typing import Any

import torch
import torch.distributed as dist

from restartable.inprocess import _torch_private
from restartable.inprocess.clock import SYSTEM, Clock
from restartable.inprocess.restart import mesh_refs
from restartable.inprocess.restart.torch_defaults import release_module_defaults

log = logging.getLogger(__name__)


# How long a released group may stay referenced before the reaper calls it a misuse, and how
# often it looks meanwhile.
_REFERENCE_GRACE_S = 1.0
_REFERENCE_POLL_S = 0.05


def abort_process_groups() -> list[Any]:
    """Abort (NCCL) and destroy every process group of this rank; never raises.

    Returns the destroyed groups (strong references): the caller keeps them until ``train()``'s
    frames are gone and then hands them to a ``GroupReaper`` (see there for why).

    Called by the monitor thread when a fault is seen, and by the main thread after ``train()``
    raised, possibly both; the second call finds nothing to do. Gloo collectives cannot be
    aborted from another thread, but destroying the group closes this rank's sockets, and that
    releases every peer blocked on this rank within milliseconds (DESIGN.md). On NCCL the
    communicators are aborted first so that pending kernels stop.
    """
    if not dist.is_available() or not dist.is_initialized():
        return []
    groups: list[Any] = []
    try:
        groups = _torch_private.live_groups()
    except Exception as exc:  # private registry changed: only the reaper's protection is lost
        log.debug("could not list process groups: %r", exc)
    if torch.cuda.is_available():
        _abort_nccl()
    try:
        dist.destroy_process_group()
    except Exception as exc:  # a group already torn down by the other thread, or broken
        log.debug("destroy_process_group failed (already torn down?): %r", exc)
    release_module_defaults(groups)
    return groups


class GroupReaper:
    """Holds this rank's destroyed process groups, then drops them on its own thread.

    Why: a gloo group's destructor waits for the collectives still queued on it to end (each
    up to the group's timeout). When the last reference is dropped by a C++ owner (DDP's
    ``Reducer``, freed with ``train()``'s frames), that wait runs with the GIL held: every
    thread of the rank, heartbeat included, freezes and the hard timeout kills a rank that was
    only waiting on a hung peer. So ``abort()`` (monitor or main thread, at a fault) destroys
    the groups and holds them while ``train()`` unwinds; ``release()`` (main thread, once it
    unwound) hands them to the reaper thread, where the destructors run through torch's holder
    that releases the GIL, and the main thread goes on restarting.

    Released groups that are still referenced elsewhere (e.g. a model kept by an object that
    outlives ``train()``) keep their sockets open, so peers blocked on this rank wait for the
    group timeout: that is logged once, with the fix. A group still referenced once handed over
    gets one ``gc.collect()`` on the reaper's thread (a DDP module is a reference cycle): never
    on the main thread, whose restart goes on meanwhile.
    """

    def __init__(
        self, *, rank: int, grace_s: float = _REFERENCE_GRACE_S, clock: Clock = SYSTEM
    ) -> None:
        self._rank = rank
        self._clock = clock
        self._grace_s = grace_s
        self._held: list[Any] = []
        # abort() runs on the monitor thread and on the main thread, possibly at once: release()
        # must not hand over the groups while an abort still holds some of them in its frame
        # (they would look "still referenced", and be held until the next fault).
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[list[Any] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._warned = False

    def abort(self) -> None:
        """Destroy this rank's groups now (see ``abort_process_groups``) and hold them."""
        with self._lock:
            self._held.extend(abort_process_groups())

    def release(self) -> None:
        """Hand the held groups to the reaper thread; ``train()``'s frames must be gone."""
        with self._lock:
            groups, self._held = self._held, []
        if not groups:
            return
        mesh_refs.release(groups)  # what torch's mesh, FSDP2 and DTensor caches keep of them
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pg-reaper", daemon=True)
            self._thread.start()
        self._queue.put(groups)
        del groups  # the reaper's references must be the last ones

    def close(self, timeout: float) -> None:
        """Stop the thread once the groups handed over so far are released (bounded wait)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout)
            self._thread = None

    def _run(self) -> None:
        while (groups := self._queue.get()) is not None:
            refs = [weakref.ref(g) for g in groups]
            del groups  # the destructors run here, GIL released while they wait
            if any(r() is not None for r in refs):
                # A DistributedDataParallel is itself a reference cycle (torch 2.13: one freed
                # with the cyclic GC only), and so is anything that refers to itself through a
                # closure: the group it holds stays until the GC happens to run, and peers
                # blocked on this rank waited for the gloo timeout (12.5 s) meanwhile. One
                # collection here, off the main thread: with freeze_gc it walks only what was
                # created since the job started.
                t0 = self._clock.monotonic()
                gc.collect()
                log.debug("rank %d: collected in %.3f s", self._rank, self._clock.monotonic() - t0)
            # A reference that goes within the grace (another thread's frame being unwound, a
            # background checkpoint job ending) released the peers as quickly: only one that
            # stays is the misuse the warning is about. This thread is off the restart's path.
            deadline = self._clock.monotonic() + self._grace_s
            while (alive := sum(r() is not None for r in refs)) and (
                self._clock.monotonic() < deadline
            ):
                self._clock.sleep(_REFERENCE_POLL_S)
            if alive and not self._warned:
                self._warned = True
                held_by = _holders(refs)
                log.warning(
                    "rank %d: %d destroyed process group(s) still referenced after train() "
                    "unwound (e.g. a DDP-wrapped model kept by an object that outlives "
                    "train()); peers blocked on this rank are released only by the group "
                    "timeout (about 1.25 x soft_timeout for gloo). Create such objects inside "
                    "train() to restart in milliseconds. Held by: %s",
                    self._rank,
                    alive,
                    held_by,
                )


def drop_frames(exc: BaseException) -> None:
    """Release the locals of ``train()``'s frames held by ``exc``'s traceback.

    A collective that raised leaves its frame (holding the process group) in the traceback; as
    long as it lives, destroying the group does not close its sockets, and peers blocked on
    this rank are not released. What the fault record needs from the traceback (the raise site)
    is read before this.
    """
    log.debug("train() unwound", exc_info=exc) if log.isEnabledFor(logging.DEBUG) else None
    # The exceptions it was raised from or during (__cause__, __context__) carry tracebacks
    # through the same frames.
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        chained = todo.pop()
        if chained is None or id(chained) in seen:
            continue
        seen.add(id(chained))
        traceback.clear_frames(chained.__traceback__)
        chained.__traceback__ = None
        todo += [chained.__cause__, chained.__context__]


def _holders(refs: list[weakref.ref[Any]], limit: int = 4) -> str:
    """Who still references the groups of ``refs``, for the warning above: the owning object
    and attribute of a ``__dict__``, a frame's function and line, else the referrer's type.
    C++ owners (DDP's ``Reducer``) are invisible to ``gc``, and so are objects frozen by
    ``freeze_gc``. Slow on a large heap: run once,
    off the restart path."""
    out = []
    for r in refs:
        obj = r()
        if obj is None:
            continue
        found = []
        for ref in gc.get_referrers(obj):  # a loop: a comprehension's cell would refer to obj
            if not _own(ref, refs):
                found.append(_describe(ref, obj))
        del obj
        out.append(
            ", ".join(found[:limit])
            # gc does not list frozen objects (freeze_gc: those that existed before train())
            or "no Python object found (a C++ owner such as DDP's Reducer, or an object created "
            "before train() first ran)"
        )
    return "; ".join(out)


def _own(ref: Any, refs: list[weakref.ref[Any]]) -> bool:
    """Whether ``ref`` is this diagnostic's own reference to a group: a frame of this module
    (the reaper's loop) or the list it walks. Named, they made the warning blame "cell" or
    "frame _run" for a reference that goes away with the diagnostic."""
    if isinstance(ref, types.FrameType):
        return ref.f_code.co_filename == __file__
    return ref is refs


def _describe(ref: Any, obj: Any) -> str:
    """One referrer of ``obj`` for the warning: the owning object and attribute of a
    ``__dict__`` (or of inline values, Python 3.11+), a frame's function and line, a function
    whose default argument it is, else the referrer's type.

    Plain loops, no comprehension over ``obj``: a comprehension is a closure on Python < 3.12,
    and its cell would be one more referrer of ``obj``, named in the warning as "cell".
    """
    if isinstance(ref, types.FrameType):
        code = ref.f_code
        return f"frame {code.co_name} ({code.co_filename}:{ref.f_lineno})"
    if isinstance(ref, tuple):  # a function's __defaults__
        for fn in gc.get_referrers(ref):
            if isinstance(fn, types.FunctionType) and fn.__defaults__ is ref:
                return f"default argument of {fn.__module__}.{fn.__qualname__}"
    attrs = getattr(ref, "__dict__", ref)
    if isinstance(attrs, dict) and attrs is ref:
        for owner in gc.get_referrers(ref):
            if getattr(owner, "__dict__", 0) is ref:
                ref = owner
                break
    names = []
    if isinstance(attrs, dict):
        for k, v in attrs.items():
            if v is obj:
                names.append(str(k))
    return type(ref).__name__ + (f" ({', '.join(names)})" if names else "")


def _abort_nccl() -> None:
    """Abort the NCCL communicators of every group (the ncclCommAbort path of torch)."""
    try:
        groups = _torch_private.live_groups()
    except Exception:
        return
    for pg in groups:
        try:
            backend = _torch_private.group_backend(pg, torch.device("cuda"))
        except Exception:  # no NCCL backend in this group
            continue
        try:
            backend.abort()
        except Exception as exc:
            log.debug("NCCL abort failed: %r", exc)
