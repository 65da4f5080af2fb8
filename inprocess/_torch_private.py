"""Every private torch API the ``inprocess`` package uses, in one place.

torch does not promise these names across releases. Each accessor here is the only caller of its
private name in the package, and ``tests/unit/test_torch_private.py`` exercises every one, so a
torch upgrade that renames or changes one fails that test loudly instead of a restart. The torch
range they were checked on is ``dependencies`` in pyproject.toml. Imported only where torch
already is (the rank's restart path), never by ``import restartable.inprocess``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def live_groups() -> list[Any]:
    """Every process group this process has not destroyed yet (the default group and subgroups).

    Torch has no public listing; the abort path needs one to hand the groups to the reaper.
    """
    return list(dist.distributed_c10d._world.pg_map)


def reset_group_counter() -> None:
    """Restart torch's per-process counter that names groups (``"0"``, ``"1"``, ...).

    Destroying the default group resets it, unless that destroy failed half-way; ranks whose
    counters differ wait forever for each other's connect keys. Call only with no default group.
    """
    dist.distributed_c10d._world.group_count = 0


def group_backend(group: Any, device: torch.device) -> Any:
    """The backend object (``ProcessGroupNCCL``, ``ProcessGroupGloo``) that ``group`` runs on
    ``device``; raises when the group has none for that device.

    The NCCL abort (``inprocess.restart.abort``) needs the communicators' owner to call its
    ``abort()``, which ``dist.destroy_process_group`` does not do before waiting.
    """
    return group._get_backend(device)


def module_states() -> list[Any]:
    """The state objects of the modules that ``fully_shard`` (or another composable API)
    manages, those not garbage collected yet (``_composable_state._module_state_mapping``,
    weakly keyed by module, each value a weak reference).

    ``inprocess.restart.mesh_refs`` walks them: FSDP2's state sits in reference cycles and
    holds the destroyed groups until a full collection. Call only once
    ``torch.distributed._composable_state`` is imported.
    """
    from torch.distributed import _composable_state

    states = []
    for ref in list(_composable_state._module_state_mapping.values()):
        state = ref()
        if state is not None:
            states.append(state)
    return states


def redistribute_planners() -> list[Any]:
    """DTensor's cached redistribution planners (``_redistribute._planner_cache``): each holds
    its mesh (so its groups) and sits in a reference cycle. Call only once
    ``torch.distributed.tensor._redistribute`` is imported."""
    from torch.distributed.tensor import _redistribute

    return list(_redistribute._planner_cache.values())


def clear_dtensor_sharding_caches() -> None:
    """Empty DTensor's sharding-propagation cache (``debug._clear_sharding_prop_cache``: the
    C++ fast path's and this thread's LRU) and its redistribution planners
    (``_redistribute.clear_redistribute_planner_cache``). Their keys hold ``DTensorSpec``s,
    each with a mesh and its groups. Call only once ``torch.distributed.tensor`` is imported."""
    from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    clear_redistribute_planner_cache()
