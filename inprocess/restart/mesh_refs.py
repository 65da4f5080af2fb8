"""Drop what torch's DeviceMesh, FSDP2 and DTensor keep of process groups a restart destroyed.

A sharded model built inside ``train()`` does not die with ``train()``'s frames: FSDP2's state
is full of reference cycles (modules, hooks, parameter groups), so it waits for a full garbage
collection, and DTensor's sharding-propagation caches keep every ``DTensorSpec`` (and so its
``DeviceMesh``) they ever saw. Each of those holds the old groups: ``FSDPMeshInfo``'s
``shard_process_group`` / ``replicate_process_group``, and ``DeviceMesh._pg_registry``. A
destroyed gloo group keeps its sockets open until its last reference goes, so a peer blocked in
a collective on it waits for the group timeout (12.6 s measured for an FSDP2 restart, against
0.1 s for DDP). ``release`` removes those references; the garbage collector frees the rest of
the old model whenever it runs. No forced ``gc.collect()``: it costs 0.1-0.5 s of GIL.

Private torch APIs used here (``tests/unit/test_mesh_refs.py`` fails when torch changes them),
named only behind the fence ``inprocess._torch_private``:
``torch.distributed._composable_state._module_state_mapping`` (the modules that ``fully_shard``
manages, weakly keyed), ``torch.distributed.tensor.debug._clear_sharding_prop_cache`` and
``torch.distributed.tensor._redistribute`` (``_planner_cache``,
``clear_redistribute_planner_cache``). Found by the walks here, not named:
``DeviceMesh._pg_registry`` and the ``functools`` caches of ``torch.distributed.tensor``'s
modules (``_gen_transform_infos``, ``ShardingPropagator._propagate_tensor_meta_cached``,
``MeshTopoInfo.build_from_mesh``), recognised by CPython's private cache type
(``inprocess._cpython_private.lru_cache_type``).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from restartable.inprocess import _torch_private
from restartable.inprocess._cpython_private import lru_cache_type

log = logging.getLogger(__name__)

# Objects of torch's distributed packages that the walk looks inside (FSDP's state, parameter
# groups and parameters, mesh infos, device meshes, DTensors and their specs). Modules and plain
# tensors are not entered: a model's weights hold no group, and walking them would cost time.
_WALKED = ("torch.distributed.",)
_MAX_OBJECTS = 200_000  # bound on one walk: a model's FSDP objects are a few per parameter
_DTENSOR_MODULES = "torch.distributed.tensor."


def release(groups: Sequence[Any]) -> int:
    """Remove the references that torch's mesh, FSDP2 and DTensor caches hold to ``groups``.

    Called by the main thread once ``train()`` has unwound, with the groups that the restart
    destroyed, before they are handed to the reaper (inprocess/restart/abort.py). Returns how many
    references were dropped. Never raises: a torch version whose internals moved only loses
    this release (logged at DEBUG; the reaper's warning then names the holder).
    """
    if not groups or "torch.distributed" not in sys.modules:
        return 0
    dead = {id(g) for g in groups}
    dropped = 0
    try:
        # First the objects that reference cycles keep until a full collection (FSDP's state,
        # DTensor's redistribution planners): their meshes let go of the groups. Then the
        # caches, whose entries die with them.
        dropped = _scrub([*fsdp_states(), *redistribute_planners()], dead)
    except Exception as exc:  # a moved private API: see the module docstring
        log.debug("could not release FSDP's references to destroyed groups: %r", exc)
    try:
        clear_dtensor_caches()
    except Exception as exc:
        log.debug("could not clear DTensor's caches: %r", exc)
    if dropped:
        log.debug("released %d reference(s) to destroyed process groups", dropped)
    return dropped


def clear_dtensor_caches() -> None:
    """Empty DTensor's caches: the sharding propagation's (C++ fast path, and the Python LRU of
    this thread), the redistribution planners and every ``functools`` cache of a DTensor module
    or class (redistribution plans, tensor metadata, mesh topology). Their keys hold
    ``DTensorSpec``s or meshes, each mesh with its groups. The next DTensor op of the new mesh
    fills them again (once per op)."""
    if "torch.distributed.tensor" not in sys.modules:
        return  # DTensor never used in this process: nothing cached
    # The planners' cache is weakly keyed by mesh, but each planner holds its mesh.
    _torch_private.clear_dtensor_sharding_caches()
    for cache in _functools_caches(_DTENSOR_MODULES):
        cache.cache_clear()


def _functools_caches(prefix: str) -> list[Any]:
    """The lru_cache / cache wrappers defined at the top of the modules named ``prefix...`` or
    in their classes (methods and static methods): found, not named, so that a cache torch adds
    later is cleared too."""
    out: dict[int, Any] = {}
    cache_type = lru_cache_type()
    for name, module in list(sys.modules.items()):
        if not name.startswith(prefix) or module is None:
            continue
        for value in list(vars(module).values()):
            candidates = [value]
            if isinstance(value, type) and value.__module__ == name:
                candidates = [getattr(v, "__func__", v) for v in vars(value).values()]
            for c in candidates:
                if isinstance(c, cache_type) and c.__module__ == name:
                    out[id(c)] = c
    return list(out.values())


def redistribute_planners() -> list[Any]:
    """DTensor's cached redistribution planners: each holds its mesh and sits in a reference
    cycle, so it outlives the cache that ``clear_dtensor_caches`` empties."""
    if "torch.distributed.tensor._redistribute" not in sys.modules:
        return []
    return _torch_private.redistribute_planners()


def fsdp_states() -> list[Any]:
    """The state objects of every module that ``fully_shard`` (or another composable API)
    manages and that is not yet garbage collected, alive or not."""
    if "torch.distributed._composable_state" not in sys.modules:
        return []
    return _torch_private.module_states()


def _scrub(roots: Iterable[Any], dead: set[int]) -> int:
    """Walk the torch.distributed objects reachable from ``roots`` (attributes, dicts, lists,
    tuples) and drop every reference to a group of ``dead``: an attribute becomes None, a dict
    entry is removed. Returns the number dropped."""
    import torch

    dropped = 0
    seen: set[int] = set()
    todo = list(roots)
    while todo and len(seen) < _MAX_OBJECTS:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            for key in [k for k, v in obj.items() if id(v) in dead]:
                del obj[key]
                dropped += 1
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo.extend(obj)
        elif isinstance(obj, torch.nn.Module) or (
            isinstance(obj, torch.Tensor) and not hasattr(obj, "_spec")
        ):
            continue  # weights and modules hold no group
        elif type(obj).__module__.startswith(_WALKED):
            for name, value in _attributes(obj):
                if id(value) in dead:
                    object.__setattr__(obj, name, None)  # frozen dataclasses too
                    dropped += 1
                else:
                    todo.append(value)
    return dropped


def _attributes(obj: Any) -> list[tuple[str, Any]]:
    """An object's attributes, from its ``__dict__`` and its ``__slots__`` (DTensor has both)."""
    out = list(getattr(obj, "__dict__", {}).items())
    for cls in type(obj).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if name not in ("__dict__", "__weakref__") and hasattr(obj, name):
                out.append((name, getattr(obj, name)))
    return out
