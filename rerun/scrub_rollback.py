"""Verified states to roll back to, and the rollback itself after the restart.

At each checked step (before the step) the rank after the checked one keeps a copy of its
training state (the replicas are equal), from the oldest step a check may still send the job
back to (the last passed check of each rank) onwards: a few copies per rank. After a finding, every
rank restarts, restores its newest checkpoint as usual, and then ``rollback`` replaces that
state by the copy of the finding's step, taken from a rank that holds it (a warm reserve that
replaced a retired rank holds none): one broadcast, on the fault path only.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from restartable.rerun import agree

logger = logging.getLogger(__name__)


class Snapshots:
    """This rank's copies of its state, by step (the state before that step)."""

    def __init__(self) -> None:
        self._by_step: dict[int, Any] = {}
        self.pending: int | None = None  # the step to roll back to after the restart

    def take(self, step: int, snapshot: Callable[[], Any]) -> None:
        self._by_step[step] = clone_tree(snapshot())

    def drop(self, step: int) -> None:
        """Forget the copy of ``step`` (taken before the step, which was then not checked)."""
        self._by_step.pop(step, None)

    def steps(self) -> list[int]:
        return sorted(self._by_step)

    def keep_from(self, oldest: int) -> None:
        """Drop copies older than ``oldest`` (no check can send the job back there)."""
        for step in [s for s in self._by_step if s < oldest]:
            del self._by_step[step]

    def forget_after(self, step: int) -> None:
        """Drop copies newer than ``step``: the run goes back there, they are abandoned."""
        for s in [s for s in self._by_step if s > step]:
            del self._by_step[s]

    def get(self, step: int) -> Any | None:
        return self._by_step.get(step)


def clone_tree(obj: Any) -> Any:
    """A copy of a state dict: tensors cloned, containers rebuilt, anything else deep-copied
    (several times faster than ``copy.deepcopy`` on an optimizer's many small tensors)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: clone_tree(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(clone_tree(v) for v in obj)
    return copy.deepcopy(obj)


def _lowest_holder(
    snaps: Snapshots, target: int, rank: int, world: int, device: torch.device
) -> torch.Tensor:
    """COLLECTIVE: ``world - r`` for the lowest rank ``r`` holding the copy of ``target``, or
    0 when no rank holds it."""
    held = torch.tensor([world - rank if snaps.get(target) is not None else 0], device=device)
    agree.reduce_max_(held)
    return held


def rollback(snaps: Snapshots, loaded: int, restore: Callable[[Any], None]) -> int:
    """COLLECTIVE (every active rank, at the start of ``train()`` after its checkpoint load):
    the step training resumes from. ``loaded``: the step restored; ``restore(state)`` loads a
    copy taken by ``snapshot``. Returns ``loaded`` unless a finding asked for another step:
    an older one (the checkpoint restored is after the verified step), or a newer one (the
    checkpoints after the verified step were quarantined, ``Scrubber(checkpoints=...)``, and
    the restore found an older one: the verified copy saves re-training the steps between)."""
    rank, world = agree.rank_and_world()
    device = agree.comm_device()
    want = torch.tensor([-1 if snaps.pending is None else snaps.pending], device=device)
    agree.reduce_max_(want)
    target = int(want.item())
    snaps.pending = None
    if target < 0:
        return loaded
    if target == loaded:
        logger.warning("sdc scrubbing: rolled back to the verified step %d (checkpoint)", target)
        return loaded
    held = _lowest_holder(snaps, target, rank, world, device)
    if int(held.item()) == 0 and target > loaded:  # older than verified: trusted too
        logger.warning(
            "sdc scrubbing: no rank holds the verified state of step %d; resuming from the "
            "older checkpoint of step %d",
            target,
            loaded,
        )
        return loaded
    if int(held.item()) == 0:
        raise RuntimeError(
            f"sdc scrubbing: no rank holds the verified state of step {target} to roll back to "
            f"(restored step {loaded}); the state since is not trusted: restart the job from a "
            "persistent checkpoint older than the corruption"
        )
    src = world - int(held.item())
    # A copy even on the source: loading may alias its tensors (an optimizer's state), and
    # training would then change the kept copy that a later finding may need again.
    box = [copy.deepcopy(snaps.get(target)) if rank == src else None]
    if agree.is_distributed():
        dist.broadcast_object_list(box, src=src)
    restore(box[0])
    snaps.forget_after(target)
    how = "rolled back from" if loaded > target else "restored over the older checkpoint of"
    logger.warning(
        "sdc scrubbing: %s step %d to the verified step %d (state of rank %d)",
        how,
        loaded,
        target,
        src,
    )
    return target
