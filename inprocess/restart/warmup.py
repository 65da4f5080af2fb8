"""What a rank's first DDP / FSDP2 construction imports, imported ahead of time on a reserve.

Measured (torch 2.13 CPU, gloo; ``sys.modules`` before and after, in a process that had
imported ``torch``, ``torch.distributed`` and ``inprocess.restart.loop``): the first
``DistributedDataParallel(...)`` imports ``torch._dynamo`` (820 modules: sympy, mpmath,
``torch._inductor.config``, ``torch.distributed.fsdp``, ``torch.distributed.tensor``, ...),
1.1-2.4 s here and 5.9 s on a loaded VM, then 0.01 s for the next one; FSDP2's
``fully_shard`` imports the same set; a CheckpointManager's first persistent load imports
``torch.distributed.checkpoint`` (0.05 s). ``init_process_group`` and the first collectives
import nothing more. A reserve that takes a dead rank's place would pay all of it between the
fault and its first step, with every other rank waiting.

Importing them starts no thread and keeps no file or socket open (checked for the warm pool's
fork server, which imports them too: ``inprocess.forkserver``). Both import them on a
thread of the lowest CPU priority, so that on a node with fewer free cores than ranks the import
takes only what the training ranks leave (about 2 s of one core once, measured here).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
import threading

from restartable.inprocess.clock import SYSTEM, Clock

log = logging.getLogger(__name__)

# What the first DDP / FSDP2 construction and the first checkpoint load import (see above).
FIRST_USE_MODULES = ("torch._dynamo", "torch.distributed.fsdp", "torch.distributed.checkpoint")
_LOWEST_PRIORITY = 19  # nice value of the importing thread
_CLOSE_WAIT_S = 60.0  # an import that takes longer is stuck: left to the interpreter's exit


class FirstUseImports:
    """Imports ``FIRST_USE_MODULES`` on a daemon thread of the lowest CPU priority.

    Owned by the restart loop of a reserve (started the first time the rank is a reserve) and
    by the fork server. ``start`` returns at once; ``wait`` blocks until the imports ended
    (call it before importing any of them on another thread: two threads importing one
    package's modules at once may see it half-built); ``close`` waits (bounded) too, so the
    interpreter never exits in the middle of an import. ``seconds``: how long the imports took,
    None until they ended. A module that fails to import is logged at DEBUG and left to fail
    where the script imports it. Not a restart point: an interrupt delivered inside an import
    would leave a half-built module in ``sys.modules`` (``inprocess.restart.monitor``).
    """

    def __init__(
        self, modules: tuple[str, ...] = FIRST_USE_MODULES, *, clock: Clock = SYSTEM
    ) -> None:
        self._modules = modules
        self._clock = clock
        self._thread: threading.Thread | None = None
        self.seconds: float | None = None

    def start(self) -> None:
        """Start the imports (once; later calls do nothing)."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="inprocess-first-use-imports", daemon=True
            )
            self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the imports ended (True) or ``timeout`` passed (False); True when never
        started."""
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def close(self) -> None:
        """Wait for the imports, bounded (idempotent)."""
        if not self.wait(_CLOSE_WAIT_S):
            log.warning("first-use imports still running after %.0f s", _CLOSE_WAIT_S)

    def _run(self) -> None:
        # Linux: the nice value of this thread only. Elsewhere it may fail: full priority.
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _LOWEST_PRIORITY)
        t0 = self._clock.monotonic()
        for name in self._modules:
            if name in sys.modules:
                continue
            try:
                importlib.import_module(name)
            except Exception as exc:
                log.debug("first-use imports: cannot import %s: %r", name, exc)
        self.seconds = self._clock.monotonic() - t0
