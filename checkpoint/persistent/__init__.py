"""The persistent tier: async torch_dist (PyTorch DCP) saves with atomic commit, verified loads."""

from restartable.checkpoint.persistent.layout import CheckpointDirs, Committed
from restartable.checkpoint.persistent.load import list_committed, load_latest
from restartable.checkpoint.persistent.save import PersistentSaver, SaveStats

__all__ = [
    "CheckpointDirs",
    "Committed",
    "PersistentSaver",
    "SaveStats",
    "list_committed",
    "load_latest",
]
