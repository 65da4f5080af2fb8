"""``PerRank``: the part of a state that differs between ranks, kept per rank by every tier.

The persistent tier writes torch_dist (DCP), which stores a value saved under the same key by
every rank once (it assumes plain data parallelism: the same on every rank). An RNG state or a
data loader's position saved that way came back as rank 0's on every rank: after a restore
from the persistent tier both ranks drew identical batches. Values under a ``PerRank`` are
keyed by the saving rank there (``<key>/rank<r>/...``), and rank ``r`` loads what rank ``r``
saved; the local tier keeps each rank's state apart anyway.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from restartable.checkpoint.errors import CheckpointConfigError


class PerRank(dict[str, Any]):
    """Marks values that differ between ranks (RNG states, data-loader positions).

    ``state = {"model": model, "opt": opt, "own": PerRank(rng=torch.get_rng_state())}``: rank
    ``r`` restores what rank ``r`` saved, from every tier. A plain dict to every other reader.
    A restore with more ranks than the save had finds no entry for the new ranks and fails with
    the missing keys named.
    """


@contextlib.contextmanager
def keyed_by_rank(state: dict[str, Any], rank: int) -> Iterator[None]:
    """Inside the block, every ``PerRank`` value ``v`` of ``state`` (at any depth of dicts and
    lists) sits at ``{"rank<rank>": v}`` in its place; the state is put back on exit.

    In place, not a copy: a load sets non-tensor values into the containers it is given, and
    they must land in the user's own (the ``PerRank`` itself is kept, so its values do too).
    Main thread, around the persistent tier's staging or load; never blocks.
    """
    if isinstance(state, PerRank):
        raise CheckpointConfigError(
            "state is a PerRank: put the per-rank values under a key of the state, e.g. "
            "{'model': model, 'own': PerRank(rng=torch.get_rng_state())}"
        )
    swaps: list[tuple[Any, Any, PerRank]] = []
    try:
        _swap(state, rank, swaps)
        yield
    finally:
        for container, key, value in reversed(swaps):
            container[key] = value


def _swap(obj: Any, rank: int, swaps: list[tuple[Any, Any, PerRank]]) -> None:
    # Module-level, not a closure that calls itself: such a closure is a reference cycle that
    # keeps `swaps` (the user's containers, a DDP module among them) until the cyclic GC runs.
    items = obj.items() if isinstance(obj, dict) else enumerate(obj)
    for k, v in list(items):
        if isinstance(v, PerRank):
            swaps.append((obj, k, v))
            obj[k] = {f"rank{rank}": v}
        elif isinstance(v, (dict, list)):
            _swap(v, rank, swaps)


def current_rank() -> int:
    """This rank in the default group (0 without torch.distributed): the key of its PerRank."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
