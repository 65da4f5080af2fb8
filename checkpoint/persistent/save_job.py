"""What one persistent save carries from the training thread to the writer thread and back.

``PersistentSaver.save`` (training thread) builds a ``SaveJob``; ``SaveProtocol.run`` (writer
thread) fills in its ``SaveStats`` and returns them, or a ``Failed``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from restartable.checkpoint.errors import CheckpointError
from restartable.checkpoint.exchange import StoreExchange


@dataclasses.dataclass
class SaveStats:
    """What one persistent save did (filled in by the background job)."""

    step: int
    stall_s: float = 0.0
    write_s: float = 0.0
    bytes_written: int = 0  # this rank's data files
    path: str = ""


@dataclasses.dataclass(frozen=True)
class Failed:
    """A background failure as data: the error class to raise on the caller's thread and args."""

    cls: type[CheckpointError]
    args: tuple[Any, ...]


@dataclasses.dataclass
class SaveJob:
    """One save: the staged state (None once written, or when staging failed) and its store."""

    step: int
    staged: dict[str, Any] | None
    stage_error: str | None
    exchange: StoreExchange
    previous: StoreExchange | None  # the save before, in the same group: its keys to delete
    stats: SaveStats
