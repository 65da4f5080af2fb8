"""Validated settings of the two checkpoint tiers, and the package's environment variables."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from restartable.checkpoint.errors import CheckpointConfigError

# Test-only: the name of a point in the background save at which the process SIGKILLs itself
# (see ``checkpoint.persistent.save.CRASH_POINTS``). Read here and nowhere else.
ENV_CRASH_AT = "RESTARTABLE_CKPT_CRASH_AT"
# Test-only: restrict the crash to this rank (default: every rank that reaches the point).
ENV_CRASH_RANK = "RESTARTABLE_CKPT_CRASH_RANK"

ON_BUSY_POLICIES = ("wait", "skip")
LOCAL_ALGOS = ("atomic", "fully_parallel")


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class LocalConfig:
    """Settings of the local (host memory / node-local directory / peer replica) tier; validates
    itself on construction. Errors name each setting as ``CheckpointManager``'s keyword
    (``local_every`` for ``every``), as ``PersistentConfig``'s do (``persistent_every``).

    Its background waits are bounded by the manager's ``timeout`` (one bound for both tiers).
    """

    every: int = 1  # save to the local tier at steps divisible by this
    dir: str | os.PathLike[str] | None = None  # node-local directory (NVMe, /dev/shm); None: memory
    replication_factor: int = 1  # copies of each shard on distinct nodes (1: no peer replicas)
    algo: str = "atomic"  # "atomic": each rank keeps all its state; "fully_parallel": see README
    keep: int = 2  # complete local steps kept (memory and directory)
    # GPU state: the copy to host memory runs on a side stream behind the next forward and
    # backward; the next optimizer step waits for it (checkpoint.local.overlap). Off until it is
    # measured on a device; CPU state is copied as before either way.
    overlap_copy: bool = False

    def __post_init__(self) -> None:
        _positive_int(
            "local_every",
            self.every,
            "pass e.g. 1 to keep a local copy every step, or no local config (local_every=None) "
            "to disable the local tier",
        )
        if self.dir is not None and (
            not isinstance(self.dir, (str, os.PathLike)) or not os.fspath(self.dir)
        ):
            raise CheckpointConfigError(
                f"local_dir ({self.dir!r}) must be None or a non-empty directory path: pass e.g. "
                "'/dev/shm/ckpt' (node-local NVMe or /dev/shm), or None for memory only"
            )
        _positive_int("replication_factor", self.replication_factor, "use 1 for no replicas")
        if self.algo not in LOCAL_ALGOS:
            raise CheckpointConfigError(
                f"local_algo ({self.algo!r}) must be one of {LOCAL_ALGOS}: pick one ('atomic', "
                "the default, unless the state marks its replicated part with ReplicatedState)"
            )
        _positive_int("local_keep", self.keep, "keep at least one local step")
        if not isinstance(self.overlap_copy, bool):
            raise CheckpointConfigError(
                f"overlap_copy ({self.overlap_copy!r}) must be True or False: pass True to "
                "overlap the copy of GPU state with the next forward and backward"
            )


def tiers_record(local: LocalConfig | None, persistent: PersistentConfig) -> dict[str, Any]:
    """What a killed rank's state survives in, for the run journal's ``tiers`` record (written
    once per manager, at its first save): the restart loop warns when its job replaces killed
    ranks but their state was in their process's memory only (``inprocess.restart.advice``)."""
    return {
        "local": local is not None,
        "local_dir": local is not None and local.dir is not None,
        "replication_factor": 1 if local is None else local.replication_factor,
        "persistent_every": persistent.every,
    }


def _positive_int(name: str, value: object, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise CheckpointConfigError(f"{name} ({value!r}) must be an integer >= 1: {fix}")
    if value < 1:
        raise CheckpointConfigError(f"{name} ({value!r}) must be >= 1: {fix}")


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


def local_config(
    local: LocalConfig | None,
    *,
    local_every: int | None,
    local_dir: str | os.PathLike[str] | None,
    replication_factor: int | None,
    local_algo: str | None,
    local_keep: int | None,
) -> LocalConfig | None:
    """The local tier's settings from ``CheckpointManager``'s ``local`` or from its loose keyword
    arguments (not both); None when the local tier is off (no ``local`` and
    ``local_every=None``)."""
    loose = {
        "local_every": local_every,
        "local_dir": local_dir,
        "replication_factor": replication_factor,
        "local_algo": local_algo,
        "local_keep": local_keep,
    }
    given = {name: value for name, value in loose.items() if value is not None}
    if local is not None:
        if not isinstance(local, LocalConfig):
            raise CheckpointConfigError(
                f"local ({type(local).__name__}) must be a LocalConfig or None: pass e.g. "
                "local=LocalConfig(every=1, dir='/dev/shm/ckpt')"
            )
        if given:
            names = ", ".join(f"{name}={value!r}" for name, value in given.items())
            raise CheckpointConfigError(
                f"local ({local!r}) and {names} both configure the local tier: pass its "
                "settings in one place, inside local=LocalConfig(...) or as keyword arguments"
            )
        return local
    if local_every is None:
        # As before LocalConfig existed: without local_every the other local settings are unused.
        return None
    default = LocalConfig()  # an argument left out (None) takes LocalConfig's default
    return LocalConfig(
        every=local_every,
        dir=local_dir,
        replication_factor=(
            default.replication_factor if replication_factor is None else replication_factor
        ),
        algo=default.algo if local_algo is None else local_algo,
        keep=default.keep if local_keep is None else local_keep,
    )
