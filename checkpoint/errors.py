"""The checkpoint package's exceptions: one base class, a few precise subclasses."""

from __future__ import annotations

from collections.abc import Mapping


class CheckpointError(Exception):
    """Base class of every error raised by the ``checkpoint`` package."""


class CheckpointConfigError(CheckpointError, ValueError):
    """A bad argument: the message names the field, the value, the rule and the fix."""


class CheckpointStorageError(CheckpointError):
    """The storage root cannot be used (missing, not writable, unreachable)."""


class CheckpointCorruptError(CheckpointError):
    """A committed checkpoint failed verification (checksum or size mismatch, missing file)."""

    def __init__(self, message: str, *, path: str = "") -> None:
        super().__init__(message)
        self.path = path


class CheckpointMismatchError(CheckpointError):
    """The state to load into does not match the checkpoint (keys or shapes); lists the keys."""

    def __init__(self, message: str, *, keys: list[str] | None = None) -> None:
        super().__init__(message)
        self.keys = list(keys or [])


class ShardingMismatchError(CheckpointMismatchError):
    """A local-tier shard was saved with another mesh or placement than the live DTensors.

    Raised on every rank by a local restore (the ranks agree first), before any tensor is
    written; ``CheckpointManager.load_latest`` catches it and loads the persistent tier, which
    reshards.
    """


class CheckpointRankError(CheckpointError):
    """A collective checkpoint operation failed on one or more ranks.

    Raised on every rank with the same message, so a failure on rank 3 does not leave ranks
    0-2 waiting or believing the save succeeded. ``failures`` maps rank -> error text.
    """

    def __init__(self, what: str, failures: Mapping[int, str]) -> None:
        self.what = what
        self.failures = dict(sorted(failures.items()))
        ranks = ", ".join(str(r) for r in self.failures)
        details = "\n".join(f"  rank {r}: {msg}" for r, msg in self.failures.items())
        super().__init__(f"{what} failed on rank(s) {ranks}:\n{details}")


class CheckpointAbandoned(CheckpointError):
    """A save in flight was abandoned (process group changed, manager closed); never visible."""
