"""Fault injection for tests, examples and drills: make a chosen rank fail in a chosen way.

from inprocess import faults
faults.inject("raise", rank=1, iteration=0, step=5, current_step=step)   # inside train()
"""

from __future__ import annotations

import ctypes
import os
import signal
import time

from inprocess.context import context
from inprocess.errors import ConfigError

KINDS = ("raise", "hang_gil_released", "hang_gil_held", "sigkill_self", "sigterm_self")
HANG_S = 24 * 3600.0  # long enough to be a hang for any test; the timeouts end it


class InjectedFault(RuntimeError):
    """The exception raised by ``inject("raise", ...)``."""


def inject(
    kind: str,
    *,
    rank: int,
    iteration: int | None = None,
    step: int | None = None,
    current_step: int | None = None,
) -> bool:
    """Fire fault ``kind`` now if this is ``rank`` (``ctx.rank``) in ``iteration`` at ``step``.

    None for ``iteration``/``step`` matches any. Returns False when it did not fire (a fault
    that fires does not return). Call inside a ``@restartable`` function.

    Kinds: ``raise`` (``InjectedFault``), ``hang_gil_released`` (``time.sleep``: the soft
    timeout ends it), ``hang_gil_held`` (a foreign C ``sleep`` through ``ctypes.PyDLL``, which
    keeps the GIL: only the watchdog's hard timeout ends it), ``sigkill_self``,
    ``sigterm_self``.
    """
    if kind not in KINDS:
        raise ConfigError(f"kind ({kind!r}) must be one of {KINDS}: pick a supported fault")
    ctx = context()
    if ctx.rank != rank:
        return False
    if iteration is not None and ctx.iteration != iteration:
        return False
    if step is not None and current_step != step:
        return False
    fire(kind, detail=f"rank {rank} iteration {ctx.iteration} step {current_step}")
    return True


def fire(kind: str, *, detail: str = "") -> None:
    """Fire fault ``kind`` in this process now, unconditionally."""
    if kind == "raise":
        raise InjectedFault(f"injected fault ({detail})")
    if kind == "hang_gil_released":
        time.sleep(HANG_S)
    elif kind == "hang_gil_held":
        # PyDLL keeps the GIL during the call: no Python thread of this process runs again.
        ctypes.PyDLL(None).sleep(int(HANG_S))
    elif kind == "sigkill_self":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "sigterm_self":
        os.kill(os.getpid(), signal.SIGTERM)
    else:
        raise ConfigError(f"kind ({kind!r}) must be one of {KINDS}: pick a supported fault")
