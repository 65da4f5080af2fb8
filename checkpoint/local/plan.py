"""The local save's pack plan: which tensors this rank keeps and where each goes in its
buffer, cached while the state's structure stays the same."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from restartable.checkpoint.local import packing, placement
from restartable.checkpoint.local.leaf import Leaf
from restartable.checkpoint.local.memo import Block, expand, picker

# Read by C over every tensor at every save (the layout check): one attribute per map, since
# a tuple of three per tensor cost half as much again to build and compare.
_DTYPE = operator.attrgetter("dtype")
_SHAPE = operator.attrgetter("shape")
_IS_CUDA = operator.attrgetter("is_cuda")


@dataclass
class Plan:
    """Per-structure plan, rebuilt when a key, dtype, shape or sharding changes, or whether a
    tensor is on a GPU."""

    signature: tuple[Any, ...]
    world: int
    rank: int
    # The tensors this rank stores, by position among the state's tensors (None: all of them;
    # fully_parallel drops the others' shares).
    kept: Callable[[Sequence[torch.Tensor]], tuple[torch.Tensor, ...]] | None
    layout: packing.ShardLayout
    entries: dict[str, packing.TensorEntry]  # layout by key: a memory restore skips the header
    on_gpu: bool  # a kept tensor is on a GPU: pinned buffer, its copy asynchronous


class PlanCache:
    """The last save's plan (LocalTier's training thread only)."""

    def __init__(self, algo: str) -> None:
        self._algo = algo
        self._last: Plan | None = None

    def plan(
        self,
        parts: list[Leaf | Block],
        tensors: list[torch.Tensor],
        structure: tuple[Any, ...],
        rank: int,
        world: int,
    ) -> Plan:
        """The cached plan if the state's tensors are laid out as at the last save, else a new
        one. A remembered mapping's keys compare as one object (its memo record); dtypes and
        shapes are read per tensor, since a tensor object keeps its identity through
        ``.data =`` and ``resize_`` (which version counters do not show)."""
        sig = (
            structure,
            tuple(map(_DTYPE, tensors)),
            tuple(map(_SHAPE, tensors)),
            any(map(_IS_CUDA, tensors)),  # the plan's only use of the devices: pinned or not
        )
        c = self._last
        if c is not None and c.signature == sig and c.world == world and c.rank == rank:
            return c
        leaves = [x for x in expand(parts) if isinstance(x.value, torch.Tensor)]
        fully_parallel = self._algo == "fully_parallel"
        owner = placement.replicated_owner(leaves, world) if fully_parallel else {}
        kept = [i for i, x in enumerate(leaves) if owner.get(x.key, rank) == rank]
        layout = packing.ShardLayout.of([leaves[i] for i in kept])
        entries = {e.key: e for e in layout.entries}
        on_gpu = any(leaves[i].value.is_cuda for i in kept)
        pick = None if len(kept) == len(leaves) else picker(kept)
        self._last = Plan(sig, world, rank, pick, layout, entries, on_gpu)
        return self._last

    def clear(self) -> None:
        self._last = None
