"""Every private CPython API the ``inprocess`` package uses, in one place.

CPython does not promise these names across releases (a leading underscore: "for internal and
specialized purposes"). Each accessor here is the only caller of its private name in the
package, and ``tests/unit/test_cpython_private.py`` exercises every one, so an interpreter
upgrade that renames or changes one fails that test loudly instead of a restart. Imported by the
restart path only (the monitor's view of the main thread, the release of DTensor's caches),
never by ``import restartable.inprocess``.
"""

from __future__ import annotations

import functools
import sys
from types import FrameType


def current_frame(thread_id: int) -> FrameType | None:
    """The frame ``thread_id`` is executing now, or None when no such thread runs.

    Needed because the monitor judges the main thread from another thread: whether it waits on
    its peers inside a collective (a grace before blaming it), whether it is inside an import
    (no restart delivered there) and where it is stuck (the soft timeout's log). Python has no
    public way to read another thread's stack; ``sys._current_frames`` (CPython, documented but
    private) is it. If CPython changes it, those three judgements fail: the monitor blames the
    waiting rank instead of the hung peer, may interrupt an import half-way, and logs no stack.
    """
    return sys._current_frames().get(thread_id)


def lru_cache_type() -> type:
    """The type of what ``functools.lru_cache`` / ``functools.cache`` return
    (``functools._lru_cache_wrapper``, the C type).

    Needed because ``inprocess.restart.mesh_refs`` finds DTensor's caches by their type (a
    cache torch adds later is cleared too) and no public name for the type exists. If CPython
    renames it, that lookup fails: DTensor's caches keep the destroyed groups alive, and a
    restart of a tensor-parallel job waits for the group timeout instead of milliseconds.
    """
    return functools._lru_cache_wrapper


def atexit_count() -> int:
    """How many ``atexit`` handlers are registered now (``atexit._ncallbacks``).

    Needed because an unmodified script re-run in place registers its ``atexit`` handlers again
    each iteration (``inprocess.script_mode.leftovers`` warns once); ``atexit`` has no public
    way to count them (an unregistered handler may still be counted: CPython clears its slot).
    If CPython removes it, that warning is lost (nothing else).
    """
    import atexit

    return int(atexit._ncallbacks())
