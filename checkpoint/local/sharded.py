"""DTensor leaves for the local tier: the local shard, and its sharding as plain data.

The local tier keeps what each rank owns: for a ``DTensor`` (FSDP2, tensor parallel, HSDP) that
is its local shard, packed like any tensor, plus the sharding it belongs to (mesh shape and dim
names, placements, global shape, this rank's mesh coordinate) as JSON in the shard's header.
A restore writes the shard back into the live DTensor's local tensor, in place, only when the
live sharding is the same; otherwise the shard is refused (``ShardingMismatchError``) and the
manager falls back to the persistent tier, which reshards.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from restartable.checkpoint.errors import ShardingMismatchError

__all__ = ["ShardingMismatchError", "describe", "is_dtensor", "local_and_sharding", "to_json"]

# The hashable form of a DTensor's sharding, taken at every save (cheap: attribute reads), and
# turned into JSON only when the state's layout changes.
Sharding = tuple[Any, ...]


def is_dtensor(obj: Any) -> bool:
    """Whether ``obj`` is a DTensor (without importing DTensor where nothing uses it)."""
    module = sys.modules.get("torch.distributed.tensor")
    # getattr, not an import statement: this runs for every tensor leaf of a save.
    dtensor = getattr(module, "DTensor", None) if module is not None else None
    return dtensor is not None and isinstance(obj, dtensor)


def local_and_sharding(dt: Any) -> tuple[torch.Tensor, Sharding]:
    """The local shard of DTensor ``dt`` (its storage: a copy into it changes ``dt``) and the
    hashable description of its sharding."""
    with torch.no_grad():
        local = dt.to_local()  # no autograd node: the DTensor's own local tensor
    mesh = dt.device_mesh
    sharding = (
        tuple(mesh.shape),
        mesh.mesh_dim_names,
        tuple(dt.placements),
        tuple(dt.shape),
        mesh.get_coordinate(),
    )
    return local, sharding


def to_json(sharding: Sharding) -> dict[str, Any]:
    """The header form of a sharding: plain JSON data (no pickle), compared on restore."""
    mesh, names, placements, shape, coord = sharding
    return {
        "mesh": list(mesh),
        "mesh_dims": list(names) if names is not None else None,
        "placements": [repr(p) for p in placements],
        "global_shape": list(shape),
        "coordinate": list(coord) if coord is not None else None,
    }


def describe(meta: dict[str, Any] | None) -> str:
    """One line for an error message: ``mesh [2] (dp), placements [Shard(dim=0)], ...``."""
    if meta is None:
        return "a plain tensor (no DTensor)"
    dims = ",".join(meta.get("mesh_dims") or [])
    return (
        f"mesh {meta.get('mesh')}{f' ({dims})' if dims else ''}, placements "
        f"{meta.get('placements')}, global shape {meta.get('global_shape')}, coordinate "
        f"{meta.get('coordinate')}"
    )
