"""Checkpointing: async torch_dist (DCP) persistent tier and a local in-memory / node-local tier.

The public names below are imported on first use (PEP 562), so that importing one light
submodule (``checkpoint.exchange``, which every ``@restartable`` rank and its etcd store import)
does not pay for torch.distributed.checkpoint (about 1 s of CPU per process, measured with
``python -X importtime``).

Two submodules are public API of every process of a job, the torch-free ones included (the
launcher, the watchdog): ``checkpoint.sealing`` (sealed store values and the job's secret) and
``checkpoint.private_files`` (directories and files only this user may write). Neither imports
torch; import them by their module names.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if __name__ != "restartable.checkpoint":  # the source tree's folder, imported by its old name
    raise ImportError(
        f"{__name__!r} is restartable's checkpoint/ folder imported by its old name: "
        "import restartable.checkpoint instead (python -m restartable.launch for the launcher)"
    )

if TYPE_CHECKING:
    from restartable.checkpoint.config import LocalConfig, PersistentConfig
    from restartable.checkpoint.errors import (
        CheckpointAbandoned,
        CheckpointConfigError,
        CheckpointCorruptError,
        CheckpointError,
        CheckpointMismatchError,
        CheckpointRankError,
        CheckpointStorageError,
        ShardingMismatchError,
    )
    from restartable.checkpoint.group import BackgroundGroup
    from restartable.checkpoint.local import ReplicatedState
    from restartable.checkpoint.manager import CheckpointManager
    from restartable.checkpoint.per_rank import PerRank
    from restartable.checkpoint.restore_choice import Restore

_HOMES = {
    "BackgroundGroup": "restartable.checkpoint.group",
    "CheckpointAbandoned": "restartable.checkpoint.errors",
    "ShardingMismatchError": "restartable.checkpoint.errors",
    "CheckpointConfigError": "restartable.checkpoint.errors",
    "CheckpointCorruptError": "restartable.checkpoint.errors",
    "CheckpointError": "restartable.checkpoint.errors",
    "CheckpointManager": "restartable.checkpoint.manager",
    "CheckpointMismatchError": "restartable.checkpoint.errors",
    "CheckpointRankError": "restartable.checkpoint.errors",
    "CheckpointStorageError": "restartable.checkpoint.errors",
    "LocalConfig": "restartable.checkpoint.config",
    "PersistentConfig": "restartable.checkpoint.config",
    "PerRank": "restartable.checkpoint.per_rank",
    "ReplicatedState": "restartable.checkpoint.local",
    "Restore": "restartable.checkpoint.restore_choice",
}
__all__ = [
    "BackgroundGroup",
    "CheckpointAbandoned",
    "CheckpointConfigError",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointMismatchError",
    "CheckpointRankError",
    "CheckpointStorageError",
    "LocalConfig",
    "PerRank",
    "PersistentConfig",
    "ReplicatedState",
    "Restore",
    "ShardingMismatchError",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later lookups do not come here again
    return value
