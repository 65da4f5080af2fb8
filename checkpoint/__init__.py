"""Checkpointing: async torch_dist (DCP) persistent tier and a local in-memory / node-local tier."""

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
from checkpoint.manager import CheckpointManager, Restore
from checkpoint.packing import ReplicatedState

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
    "ReplicatedState",
    "Restore",
]
