"""Checkpointing: async torch_dist (DCP) persistent tier and a local in-memory / node-local tier."""

from checkpoint.config import LocalConfig, PersistentConfig
from checkpoint.errors import (
    CheckpointAbandoned,
    CheckpointConfigError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointRankError,
    CheckpointStorageError,
)
from checkpoint.group import BackgroundGroup
from checkpoint.local import ReplicatedState
from checkpoint.manager import CheckpointManager, Restore

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
    "PersistentConfig",
    "ReplicatedState",
    "Restore",
]
