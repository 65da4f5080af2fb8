"""inprocess.restart.mesh_refs: torch's mesh, FSDP2 and DTensor caches let go of destroyed groups.

The first tests pin the private torch APIs the module relies on: when one fails, torch changed,
and inprocess/restart/mesh_refs.py must be updated (its docstring lists them).
"""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch
import torch.distributed as dist

# Imported before any group exists, as a training script does at its top: imported after
# init_process_group, its functions' default arguments would pin the group (released elsewhere).
import torch.distributed.nn.functional
from torch import nn
from torch.distributed import _composable_state
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor._redistribute import (
    _gen_transform_infos,
    clear_redistribute_planner_cache,
)
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.distributed.tensor.debug import _clear_sharding_prop_cache
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from restartable.inprocess.restart import mesh_refs


def _train(parallel: str) -> dict[str, weakref.ref[Any]]:
    """Build, step and drop a sharded model, as one iteration's train() does."""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("x",))
    if parallel == "fsdp":
        for layer in (model[0], model[2], model):
            fully_shard(layer, mesh=mesh)
    else:
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    return {"model": weakref.ref(model), "mesh": weakref.ref(mesh)}


def _destroy() -> list[Any]:
    groups = list(dist.distributed_c10d._world.pg_map)
    dist.destroy_process_group()
    return groups


def test_private_torch_apis_are_where_mesh_refs_expects_them(group: None) -> None:
    model = nn.Linear(8, 8)
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("x",))
    fully_shard(model, mesh=mesh)
    mapping = _composable_state._module_state_mapping
    assert isinstance(mapping, weakref.WeakKeyDictionary)
    state = mapping[model]()  # module -> weakref to its FSDP state
    assert state is not None and state in mesh_refs.fsdp_states()
    assert isinstance(mesh, DeviceMesh)
    # The mesh holds its groups in this registry; the walk finds it as a plain dict attribute.
    assert dist.group.WORLD in mesh._pg_registry.values()
    assert callable(_clear_sharding_prop_cache)
    assert callable(clear_redistribute_planner_cache)
    caches = mesh_refs._functools_caches("torch.distributed.tensor.")
    assert ShardingPropagator._propagate_tensor_meta_cached in caches
    assert _gen_transform_infos in caches


@pytest.mark.parametrize("parallel", ["fsdp", "tp"])
def test_a_dropped_sharded_model_keeps_no_destroyed_group_alive(group: None, parallel: str) -> None:
    refs = _train(parallel)
    groups = _destroy()
    alive = weakref.ref(groups[0])
    mesh_refs.release(groups)
    del groups
    # No gc.collect(): the FSDP state's cycles are still there, only the groups are let go.
    assert alive() is None, f"{parallel}: the destroyed group is still referenced"
    assert refs["model"]() is None or parallel == "fsdp"  # FSDP's cycles wait for the gc


def test_without_release_the_group_stays_referenced(group: None) -> None:
    # What the release is for: without it, FSDP's state and DTensor's caches keep the group.
    _train("fsdp")
    groups = _destroy()
    alive = weakref.ref(groups[0])
    del groups
    try:
        assert alive() is not None
    finally:
        mesh_refs.release([alive()])


def test_release_leaves_live_groups_alone(group: None) -> None:
    model = nn.Linear(8, 8)
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("x",))
    fully_shard(model, mesh=mesh)
    other = object()  # a group some other job destroyed: not referenced here
    assert mesh_refs.release([other]) == 0
    assert dist.group.WORLD in mesh._pg_registry.values()
    model(torch.randn(2, 8)).sum().backward()  # the model still trains


def test_release_without_torch_distributed_state_does_nothing() -> None:
    assert mesh_refs.release([]) == 0
