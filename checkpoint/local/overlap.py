"""The local tier's overlapped snapshot of GPU state: the device-to-host copy runs on a side
stream behind the next forward and backward, and the next write of the state waits for it.

Order, all on the training thread:

1. ``LocalTier.save`` -> ``Snapshots.start``: the side stream waits for the work queued so far
   on the training stream (the copy sees the optimizer step just taken), the copy into the
   pinned buffer is queued on the side stream between two events, and ``save()`` returns.
2. The next forward and backward run on the training stream while the copy runs: they only
   read the state.
3. The next writer of the state calls ``Snapshots.guard``: the optimizer's step (a global step
   pre-hook the tier registers), ``CheckpointManager.before_write()`` for a user's own in-place
   write, and the tier itself before its next save, load or wait. The training stream then
   waits for the copy's end event on the device (the CPU does not block), and the snapshot is
   handed on: the tier's thread waits for the event, then holds the buffer and starts its
   node-local and replica writes.

A state tensor written before the guard (its version counter moved since the copy was queued)
may have raced the copy. That snapshot is dropped, never published, and the tier copies
synchronously from then on, with one warning that names the tensor: a torn snapshot is
impossible, not merely unlikely. A process killed between the copy and its event publishes
nothing: the restore takes the step before.

The stream and event calls sit behind ``DeviceOps`` so that the decisions here (what waits on
what, what is published or dropped) are tested on a CPU with a fake (tests/unit/test_overlap.py).
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from restartable.checkpoint._torch_private import version_counter

log = logging.getLogger(__name__)


class DeviceOps(Protocol):
    """The stream and event calls of an overlapped snapshot (``CudaOps`` on a GPU)."""

    def new_stream(self) -> Any: ...

    def wait_for_current(self, stream: Any) -> None:
        """`stream` waits for the work queued so far on the current stream."""

    def on(self, stream: Any) -> AbstractContextManager[Any]:
        """Work queued inside the block goes to `stream`."""

    def record(self, stream: Any | None = None) -> Any:
        """A timing event recorded on `stream` (None: the current stream)."""

    def done(self, event: Any) -> bool: ...

    def synchronize(self, event: Any) -> None:
        """Block the calling thread until `event` completed."""

    def current_waits(self, event: Any) -> None:
        """The current stream waits for `event` on the device; the CPU does not block."""

    def elapsed_ms(self, start: Any, end: Any) -> float: ...


class CudaOps:
    """``DeviceOps`` over torch.cuda."""

    def new_stream(self) -> Any:
        return torch.cuda.Stream()

    def wait_for_current(self, stream: Any) -> None:
        stream.wait_stream(torch.cuda.current_stream())

    def on(self, stream: Any) -> AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def record(self, stream: Any | None = None) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def done(self, event: Any) -> bool:
        return bool(event.query())

    def synchronize(self, event: Any) -> None:
        event.synchronize()

    def current_waits(self, event: Any) -> None:
        torch.cuda.current_stream().wait_event(event)

    def elapsed_ms(self, start: Any, end: Any) -> float:
        return float(start.elapsed_time(end))


# Hands a guarded snapshot on; called with the wait for its copy (the tier's thread runs it).
Publish = Callable[[Callable[[], None]], None]


@dataclass
class _Pending:
    """A snapshot whose copy was queued and that no writer has guarded yet."""

    # Kept alive until the guard: the caching allocator must not give a freed source's memory
    # to a new tensor while the side stream still reads it.
    tensors: Sequence[torch.Tensor]
    versions: list[int]
    names: Sequence[str]
    events: tuple[Any, Any, Any]  # copy start, copy end (side stream); save() returned (training)
    publish: Publish


class Snapshots:
    """The overlapped copies of one tier: at most one snapshot pending a guard at a time.

    Used by one thread, the training thread (the tier's thread only runs the wait it is given).
    """

    def __init__(self, ops: DeviceOps) -> None:
        self._ops = ops
        self._stream: Any = None
        self._pending: _Pending | None = None
        self._figures: tuple[Any, Any, Any, Any] | None = None  # the last guarded snapshot's
        self._told_slow = False
        self.active = True  # False after a raced write: the tier copies synchronously

    def start(
        self,
        tensors: Sequence[torch.Tensor],
        names: Sequence[str],
        copy: Callable[[], int],
        publish: Publish,
    ) -> int:
        """Queue `copy` (which returns the bytes it packs) on the side stream; `publish` is
        called at the guard. The previous snapshot must have been guarded (the tier's save
        settles it first)."""
        if self._pending is not None:
            raise AssertionError("an overlapped snapshot started before the last one was guarded")
        if self._stream is None:
            self._stream = self._ops.new_stream()
        ops = self._ops
        ops.wait_for_current(self._stream)
        start = ops.record(self._stream)
        with ops.on(self._stream):
            nbytes = copy()
        end = ops.record(self._stream)
        returned = ops.record()
        versions = [version_counter(t) for t in tensors]
        self._pending = _Pending(tensors, versions, names, (start, end, returned), publish)
        return nbytes

    def guard(self) -> None:
        """Before the state is written: order the write after the pending copy and publish it,
        or drop the snapshot if a state tensor was already written since its copy was queued."""
        p = self._pending
        if p is None:
            return
        self._pending = None
        moved = [i for i, t in enumerate(p.tensors) if version_counter(t) != p.versions[i]]
        if moved:
            self.active = False
            log.warning(
                "local checkpoint: %r was written in place after save() returned and before "
                "the optimizer's step, while its copy to host memory may still have been "
                "running; that step's local snapshot is dropped and the tier copies GPU state "
                "synchronously from now on (call CheckpointManager.before_write() before such "
                "a write to keep the copy overlapped)",
                p.names[moved[0]],
            )
            self._ops.synchronize(p.events[1])  # the buffer goes back to the pool whole
            return
        self._ops.current_waits(p.events[1])
        self._figures = (*p.events, self._ops.record())
        end = p.events[1]
        p.publish(lambda: self._ops.synchronize(end))

    def guard_optimizer_steps(self) -> RemovableHandle:
        """Guard before every optimizer's step in this process (torch's global step pre-hook,
        holding this object weakly); the caller removes the handle when it closes."""
        guard = weakref.WeakMethod(self.guard)

        def hook(*_: object) -> None:
            live = guard()
            if live is not None:
                live()

        return register_optimizer_step_pre_hook(hook)

    def settle(self) -> None:
        """The tier's own entry points (save, load, wait, close) call this first: guard the
        pending snapshot, and say once if copies are longer than what they hide behind."""
        self.guard()
        self._tell_if_slow()

    def _tell_if_slow(self) -> None:
        figures = self._figures
        if figures is None or self._told_slow or not self._ops.done(figures[3]):
            return
        self._figures = None
        start, end, returned, written = figures
        copy_ms = self._ops.elapsed_ms(start, end)
        hidden_ms = self._ops.elapsed_ms(returned, written)
        if copy_ms <= hidden_ms:
            return
        self._told_slow = True
        every = max(2, math.ceil(copy_ms / max(hidden_ms, 1e-3)))
        log.warning(
            "local checkpoint: the copy of the state to host memory took %.1f ms, longer than "
            "the %.1f ms of forward and backward it overlaps: each saving step waits about "
            "%.1f ms for it; saving every %d steps (local_every=%d) would hide it",
            copy_ms,
            hidden_ms,
            copy_ms - hidden_ms,
            every,
            every,
        )
