"""The few small object collectives the background save and load need (None group = 1 rank)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


def rank_and_size(group: ProcessGroup | None) -> tuple[int, int]:
    """This process's rank in ``group`` and the group's size ((0, 1) without a group)."""
    if group is None:
        return 0, 1
    import torch.distributed as dist

    return dist.get_rank(group), dist.get_world_size(group)


def all_gather(obj: Any, group: ProcessGroup | None) -> list[Any]:
    """Every rank's ``obj`` (picklable), indexed by group rank. Bounded by the group timeout."""
    if group is None:
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast(obj: Any, group: ProcessGroup | None) -> Any:
    """Group rank 0's ``obj`` on every rank."""
    if group is None:
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, group_src=0, group=group)
    return box[0]
