"""Section timers: each section's own compute time, per entry (CPU time, or CUDA events).

A step's wall time is equalised across data-parallel ranks by the gradient all-reduce (the fast
ranks wait for the slow one), so it cannot show a straggler. What can is each rank's own work:
on CPU the process's CPU time (a wait in a collective blocks without using CPU), on CUDA the
device time between two events around the section.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

from restartable.straggler.errors import SectionError

# Samples kept per section between two reports: bounds memory on a long interval; a quantile
# of the newest MAX_SAMPLES entries is as good as that of all of them.
MAX_SAMPLES = 4096
# CUDA event pairs not yet read: read (after synchronising) once this many are pending.
MAX_PENDING_EVENTS = 1024


class Section:
    """One named section of one detector: a reusable context manager (``Detector.section``).

    Called from the training thread only. ``__enter__``/``__exit__`` cost two clock reads (or
    two event records) when the entry is profiled, one counter increment otherwise.
    """

    __slots__ = (
        "_clock",
        "_cuda",
        "_every",
        "_open",
        "_pending",
        "_seen",
        "_start",
        "name",
        "samples",
    )

    def __init__(
        self, name: str, *, every: int, cuda: bool, clock: Callable[[], float] = time.process_time
    ) -> None:
        self.name = name
        self.samples: deque[float] = deque(maxlen=MAX_SAMPLES)
        self._every = every
        self._seen = 0
        self._open = False
        self._start: Any = 0.0
        self._cuda = cuda
        self._clock = clock
        self._pending: list[tuple[Any, Any]] = []

    def __enter__(self) -> Section:
        if self._open:
            raise SectionError(
                f"section {self.name!r} was entered while it is open (nested in itself): "
                "close it first, or give the inner block another name"
            )
        self._open = True
        self._seen += 1
        if self._seen % self._every == 0:
            self._start = self._begin()
        else:
            self._start = None
        return self

    def __exit__(self, *exc: object) -> None:
        self._open = False
        start, self._start = self._start, None
        if start is None:
            return
        if self._cuda:
            import torch

            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending.append((start, end))
            if len(self._pending) >= MAX_PENDING_EVENTS:
                self.collect()
        else:
            self.samples.append(self._clock() - start)

    def _begin(self) -> Any:
        if not self._cuda:
            return self._clock()
        import torch

        start = torch.cuda.Event(enable_timing=True)
        start.record()
        return start

    def collect(self) -> None:
        """Turn pending CUDA event pairs into samples (seconds); waits for their kernels."""
        for start, end in self._pending:
            end.synchronize()
            self.samples.append(start.elapsed_time(end) / 1000.0)
        self._pending.clear()

    def drain(self) -> list[float]:
        """The samples since the last drain (seconds), oldest first; the section starts afresh."""
        self.collect()
        out = list(self.samples)
        self.samples.clear()
        return out


def cuda_timing(timer: str) -> bool:
    """Whether sections use CUDA events for ``timer`` ("auto", "cpu", "cuda").

    "auto": CUDA events when CUDA is available, unless the default process group has no NCCL
    backend (gloo: a job whose tensors are on the CPU, also on a host with GPUs, where events on
    an idle device would time nothing and every rank would look equally fast).
    """
    if timer == "cpu":
        return False
    try:
        import torch

        available = torch.cuda.is_available()
    except ImportError:
        available = False
    if timer == "cuda" and not available:
        from restartable.straggler.errors import ConfigError

        raise ConfigError("timer ('cuda') needs CUDA, which is not available: use 'auto' or 'cpu'")
    if timer == "auto" and available:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return "nccl" in str(dist.get_backend())
    return available
