"""Staging: copy a DCP-style state into host buffers that are reused from save to save.

This is the only part of a persistent save that blocks the training loop. The buffers (one host
tensor per state tensor, pinned where the source is on a GPU) are allocated when the layout
changes and reused, so after the first save a stage is a plain memory copy with no allocation
and no page faults. The staged tree has the same structure as the input, with every tensor
replaced by a view into the pool and every other leaf deep-copied, so mutating the live state
after ``stage()`` returns never changes what is written.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful

from restartable.checkpoint import _torch_private
from restartable.checkpoint.errors import CheckpointConfigError

log = logging.getLogger(__name__)

_Path = tuple[Any, ...]


def expand_stateful(state: Mapping[str, Any]) -> dict[str, Any]:
    """Replace top-level ``Stateful`` values by their ``state_dict()`` (DCP's convention)."""
    return {k: (v.state_dict() if isinstance(v, Stateful) else v) for k, v in state.items()}


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _collect(obj: Any, path: _Path, out: list[tuple[_Path, torch.Tensor]]) -> None:
    if isinstance(obj, torch.Tensor):
        out.append((path, _local(obj)))
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            _collect(v, (*path, k), out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _collect(v, (*path, i), out)


class StagingPool:
    """Reusable host buffers for one rank's state. Owned by the persistent saver.

    Not thread-safe: the saver stages only while no background write reads the pool (it waits
    for the previous save first), which is what makes reuse safe.
    """

    def __init__(self) -> None:
        self._signature: tuple[Any, ...] | None = None
        self._views: dict[_Path, torch.Tensor] = {}
        self.nbytes = 0

    def stage(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """Copy ``state`` into the pool and return the staged tree. Blocks until copied."""
        if not isinstance(state, Mapping):
            raise CheckpointConfigError(
                f"state ({type(state).__name__}) must be a dict of tensors, nested dicts and "
                "Stateful objects: wrap it, e.g. {'model': model, 'optimizer': optimizer}"
            )
        expanded = expand_stateful(state)
        leaves: list[tuple[_Path, torch.Tensor]] = []
        _collect(expanded, (), leaves)
        self._ensure_layout(leaves)
        any_cuda = any(src.is_cuda for _, src in leaves)
        if leaves:
            # One call for every copy: a Python loop over thousands of small tensors costs
            # more than their bytes.
            with torch.no_grad():
                _torch_private.foreach_copy(
                    [self._views[path] for path, _ in leaves],
                    [src for _, src in leaves],
                    non_blocking=any_cuda,
                )
        if any_cuda:
            # non_blocking device->host copies must land before the writer (or the caller,
            # mutating the source) runs.
            torch.cuda.synchronize()
        return self._rebuild(expanded, ())

    def _ensure_layout(self, leaves: list[tuple[_Path, torch.Tensor]]) -> None:
        signature = tuple((p, tuple(t.shape), t.dtype, t.is_cuda) for p, t in leaves)
        if signature == self._signature:
            return
        # Page-locked only for GPU sources (full-speed device-to-host copies): pinning a CPU
        # state's buffers would only create a CUDA context in every rank of a CPU job.
        pin = any(t.is_cuda for _, t in leaves)
        # Drop the old buffers before allocating new ones: peak memory is one set.
        self._views = {}
        # One allocation per tensor, not views into one flat buffer: DCP's writer clones any
        # tensor whose storage is larger than the tensor itself (a view), which would add a
        # full extra copy (and its page faults) to every background write.
        self._views = {
            path: torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda) for path, t in leaves
        }
        self._signature = signature
        self.nbytes = sum(t.numel() * t.element_size() for _, t in leaves)
        log.info(
            "checkpoint: staging buffers laid out for %d tensors, %.1f MiB%s",
            len(leaves),
            self.nbytes / 2**20,
            " (pinned)" if pin else "",
        )

    def _rebuild(self, obj: Any, path: _Path) -> Any:
        if isinstance(obj, torch.Tensor):
            view = self._views[path]
            from torch.distributed.tensor import DTensor

            if isinstance(obj, DTensor):
                # Not DTensor.from_local: it would copy a GPU mesh's shard back to the GPU.
                return _torch_private.dtensor_with_local(view, obj)
            return view
        if isinstance(obj, Mapping):
            return {k: self._rebuild(v, (*path, k)) for k, v in obj.items()}
        if isinstance(obj, tuple):
            return tuple(self._rebuild(v, (*path, i)) for i, v in enumerate(obj))
        if isinstance(obj, list):
            return [self._rebuild(v, (*path, i)) for i, v in enumerate(obj)]
        return copy.deepcopy(obj)

    def release(self) -> None:
        """Free the buffers (the next stage allocates again)."""
        self._views = {}
        self._signature = None
        self.nbytes = 0
