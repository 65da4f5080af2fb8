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

if TYPE_CHECKING:
    from checkpoint.config import LocalConfig, PersistentConfig
    from checkpoint.errors import (
        CheckpointAbandoned,
        CheckpointConfigError,
        CheckpointCorruptError,
        CheckpointError,
        CheckpointMismatchError,
        CheckpointRankError,
        CheckpointStorageError,
        ShardingMismatchError,
    )
    from checkpoint.group import BackgroundGroup
    from checkpoint.local import ReplicatedState
    from checkpoint.manager import CheckpointManager
    from checkpoint.per_rank import PerRank
    from checkpoint.restore_choice import Restore

_HOMES = {
    "BackgroundGroup": "checkpoint.group",
    "CheckpointAbandoned": "checkpoint.errors",
    "ShardingMismatchError": "checkpoint.errors",
    "CheckpointConfigError": "checkpoint.errors",
    "CheckpointCorruptError": "checkpoint.errors",
    "CheckpointError": "checkpoint.errors",
    "CheckpointManager": "checkpoint.manager",
    "CheckpointMismatchError": "checkpoint.errors",
    "CheckpointRankError": "checkpoint.errors",
    "CheckpointStorageError": "checkpoint.errors",
    "LocalConfig": "checkpoint.config",
    "PersistentConfig": "checkpoint.config",
    "PerRank": "checkpoint.per_rank",
    "ReplicatedState": "checkpoint.local",
    "Restore": "checkpoint.restore_choice",
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
