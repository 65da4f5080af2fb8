"""Validated settings of the persistent checkpoint tier, and the package's environment variables."""

from __future__ import annotations

import dataclasses
import os

from checkpoint.errors import CheckpointConfigError

# Test-only: the name of a point in the background save at which the process SIGKILLs itself
# (see ``checkpoint.async_save.CRASH_POINTS``). Read here and nowhere else.
ENV_CRASH_AT = "RESTARTABLE_CKPT_CRASH_AT"
# Test-only: restrict the crash to this rank (default: every rank that reaches the point).
ENV_CRASH_RANK = "RESTARTABLE_CKPT_CRASH_RANK"

ON_BUSY_POLICIES = ("wait", "skip")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PersistentConfig:
    """Settings of the persistent (torch_dist) tier; validates itself on construction."""

    root: str
    every: int = 100  # save at steps divisible by this
    keep: int = 3  # committed checkpoints kept; older ones are deleted after a newer commit
    timeout: float = 600.0  # seconds, bound of every background collective and wait
    fallback_on_corruption: bool = True  # load_latest: corrupt newest -> previous, with a warning
    on_busy: str = "wait"  # a save() while one is in flight: "wait" for it, or "skip" this one
    thread_count: int = 1  # DCP writer threads per rank

    def __post_init__(self) -> None:
        if not isinstance(self.root, str) or not self.root:
            raise CheckpointConfigError(
                f"root ({self.root!r}) must be a non-empty path or fsspec URL: "
                "pass e.g. 'ckpts/' or 'file:///data/ckpts'"
            )
        _positive_int("persistent_every", self.every, "pass e.g. 100")
        _positive_int("keep", self.keep, "keep at least 1 committed checkpoint")
        _positive_int("thread_count", self.thread_count, "pass 1 (the default)")
        if isinstance(self.timeout, bool) or not (
            isinstance(self.timeout, (int, float)) and self.timeout > 0
        ):
            raise CheckpointConfigError(
                f"timeout ({self.timeout!r}) must be a positive number of seconds: pass e.g. 600.0"
            )
        if self.on_busy not in ON_BUSY_POLICIES:
            raise CheckpointConfigError(
                f"on_busy ({self.on_busy!r}) must be one of {ON_BUSY_POLICIES}: "
                "use 'wait' (the default) to never drop a checkpoint"
            )


def _positive_int(name: str, value: object, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CheckpointConfigError(f"{name} ({value!r}) must be an integer >= 1: {fix}")


@dataclasses.dataclass(frozen=True)
class TestHooks:
    """Fault-injection settings read from the environment (tests only; empty in production)."""

    crash_at: str | None = None
    crash_rank: int | None = None


def read_test_hooks() -> TestHooks:
    """Read the package's environment variables (the only place that reads them)."""
    crash_at = os.environ.get(ENV_CRASH_AT) or None
    rank = os.environ.get(ENV_CRASH_RANK)
    return TestHooks(crash_at=crash_at, crash_rank=int(rank) if rank else None)
