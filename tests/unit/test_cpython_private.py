"""The private CPython APIs we depend on (``inprocess/_cpython_private.py``) still behave as we
use them.

If one of these fails after a Python upgrade, CPython changed a private name or its behaviour:
fix the accessor in the fence module (and only there). Each test checks what the caller relies
on, not only that the name exists.
"""

from __future__ import annotations

import functools
import threading

from restartable.inprocess import _cpython_private


def test_current_frame_is_what_another_thread_runs_now() -> None:
    started, release = threading.Event(), threading.Event()

    def blocked_here() -> None:
        started.set()
        release.wait(10)

    t = threading.Thread(target=blocked_here)
    t.start()
    try:
        started.wait(10)
        assert t.ident is not None
        frame = _cpython_private.current_frame(t.ident)
        names = []
        while frame is not None:
            names.append(frame.f_code.co_name)
            frame = frame.f_back
        assert "blocked_here" in names
    finally:
        release.set()
        t.join()
    assert _cpython_private.current_frame(t.ident) is None  # the thread is gone


def test_lru_cache_type_is_the_type_of_every_functools_cache() -> None:
    @functools.lru_cache(maxsize=4)
    def bounded(x: int) -> int:
        return x

    @functools.cache
    def unbounded(x: int) -> int:
        return x

    cache_type = _cpython_private.lru_cache_type()
    assert isinstance(bounded, cache_type) and isinstance(unbounded, cache_type)
    assert not isinstance(len, cache_type)


def test_atexit_count_counts_registered_handlers() -> None:
    import atexit

    def handler() -> None:
        pass

    before = _cpython_private.atexit_count()
    atexit.register(handler)
    try:
        assert _cpython_private.atexit_count() == before + 1
    finally:
        atexit.unregister(handler)
