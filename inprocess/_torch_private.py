"""Every private torch API the ``inprocess`` package uses, in one place.

torch does not promise these names across releases. Each accessor here is the only caller of its
private name in the package, and ``tests/unit/test_torch_private.py`` exercises every one, so a
torch upgrade that renames or changes one fails that test loudly instead of a restart. The torch
range they were checked on is ``dependencies`` in pyproject.toml. Imported only where torch
already is (the rank's restart path), never by ``import inprocess``.
"""

from __future__ import annotations

from typing import Any

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
