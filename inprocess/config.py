"""``RestartConfig``: every knob of ``@restartable``, validated when it is built."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from inprocess.errors import ConfigError

GRANULARITIES = ("rank", "node")
# NVIDIA's default heartbeat interval; a shorter hard_timeout shortens it (a third of it).
_HEARTBEAT_INTERVAL_CAP = 30.0


@dataclass(frozen=True, kw_only=True)
class RestartConfig:
    """How ``@restartable`` detects faults and restarts ``train()``. Durations are seconds.

    Names follow Megatron-Bridge's ``InProcessRestartConfig`` where the meaning is the same.

    * ``soft_timeout``: no progress of the main thread for this long -> a fault of this rank.
    * ``hard_timeout``: no heartbeat for this long -> the watchdog kills the rank (> soft).
    * ``heartbeat_interval``: how often the rank's heartbeat thread beats its watchdog. Unset
      (None): ``min(30, hard_timeout / 3)``, so setting only the two
      timeouts (e.g. ``soft_timeout=10, hard_timeout=20``) gives a working config
      (``effective_heartbeat_interval`` is the value in use).
    * ``heartbeat_timeout``: accepted for compatibility with NVIDIA's ``InProcessRestartConfig``
      and ignored (a warning says so when it is set): a lost rank is detected by its watchdog
      (process death, in milliseconds) or by ``hard_timeout``. Set together with
      ``heartbeat_interval``, it must exceed it (NVIDIA's rule).
    * ``barrier_timeout``: bound of every barrier between iterations.
    * ``completion_timeout``: bound of the wait for the other active ranks after ``train()``
      returned on this one.
    * ``max_iterations``: at most this many calls of ``train()`` (None: unbounded).
    * ``active_world_size`` / ``min_active_world_size``: ranks running ``train()`` (the rest
      are warm reserves) and the smallest world the job may shrink to.
    * ``granularity``: "rank" retires only a lost rank, "node" its whole node.
    * ``max_rank_faults``: a rank that faulted more often is retired (None: never).
    * ``max_same_fault``: the same fault (kind, exception type, place, step; on whichever rank)
      this many times in a row stops the job.
    * ``empty_cuda_cache``: free cached GPU memory between iterations.
    * ``monitor_process_logdir``: directory for the watchdog processes' logs.
    * ``termination_grace_time``: SIGTERM -> SIGKILL delay of a hard-timeout kill.
    * ``init_process_group`` / ``backend``: create the default process group for the active
      ranks before every call (backend None: nccl with CUDA, else gloo).
    * ``prewarm``: called once on a reserve rank while it waits.
    * ``health_checks``: callables run before every iteration; raising retires the rank.
    """

    soft_timeout: float = 60.0
    hard_timeout: float = 90.0
    heartbeat_interval: float | None = None
    heartbeat_timeout: float | None = None
    barrier_timeout: float = 120.0
    completion_timeout: float = 120.0
    max_iterations: int | None = None
    active_world_size: int | None = None
    min_active_world_size: int = 1
    granularity: str = "rank"
    max_rank_faults: int | None = None
    empty_cuda_cache: bool = True
    monitor_process_logdir: str | None = None
    termination_grace_time: float = 1.0
    init_process_group: bool = True
    backend: str | None = None
    max_same_fault: int = 3
    prewarm: Callable[[], Any] | None = None
    health_checks: Sequence[Callable[[], Any]] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        for name in (
            "soft_timeout",
            "hard_timeout",
            "heartbeat_interval",
            "heartbeat_timeout",
            "barrier_timeout",
            "completion_timeout",
        ):
            value = getattr(self, name)
            if value is not None or not name.startswith("heartbeat"):
                _positive(name, value)
        if self.termination_grace_time < 0 or math.isnan(self.termination_grace_time):
            raise ConfigError(
                f"termination_grace_time ({self.termination_grace_time}) must be >= 0 seconds: "
                "give 0 to SIGKILL at once, or a small positive grace"
            )
        if self.hard_timeout <= self.soft_timeout:
            raise ConfigError(
                f"hard_timeout ({self.hard_timeout}) must be greater than soft_timeout "
                f"({self.soft_timeout}): raise hard_timeout"
            )
        self._check_heartbeat()
        for name in ("max_iterations", "active_world_size", "max_rank_faults"):
            value = getattr(self, name)
            if value is not None:
                _positive_int(name, value, none_ok=True)
        _positive_int("min_active_world_size", self.min_active_world_size, none_ok=False)
        _positive_int("max_same_fault", self.max_same_fault, none_ok=False)
        if (
            self.active_world_size is not None
            and self.min_active_world_size > self.active_world_size
        ):
            raise ConfigError(
                f"min_active_world_size ({self.min_active_world_size}) must be <= "
                f"active_world_size ({self.active_world_size}): lower min_active_world_size"
            )
        if self.granularity not in GRANULARITIES:
            raise ConfigError(
                f"granularity ({self.granularity!r}) must be one of {GRANULARITIES}: "
                "use 'rank' to retire one rank per fault or 'node' to retire its node"
            )
        if self.backend is not None and (not isinstance(self.backend, str) or not self.backend):
            raise ConfigError(
                f"backend ({self.backend!r}) must be a non-empty backend name: use 'gloo' or "
                "'nccl', or None to pick nccl with CUDA and gloo otherwise"
            )
        if self.prewarm is not None and not callable(self.prewarm):
            raise ConfigError(
                f"prewarm ({self.prewarm!r}) must be callable or None: pass a function"
            )
        checks = tuple(self.health_checks)
        for i, check in enumerate(checks):
            if not callable(check):
                raise ConfigError(
                    f"health_checks[{i}] ({check!r}) must be callable: pass functions that "
                    "raise when the rank is unhealthy"
                )
        object.__setattr__(self, "health_checks", checks)

    @property
    def effective_heartbeat_interval(self) -> float:
        """``heartbeat_interval``, or the value derived from ``hard_timeout`` when unset.

        Derived here rather than stored, so ``dataclasses.replace(cfg, hard_timeout=...)``
        derives it again instead of keeping a value the user never set.
        """
        if self.heartbeat_interval is not None:
            return self.heartbeat_interval
        return min(_HEARTBEAT_INTERVAL_CAP, self.hard_timeout / 3)

    def _check_heartbeat(self) -> None:
        interval, timeout = self.effective_heartbeat_interval, self.heartbeat_timeout
        if interval >= self.hard_timeout:  # only a value the user set can fail this
            raise ConfigError(
                f"heartbeat_interval ({interval}) must be less than hard_timeout "
                f"({self.hard_timeout}): lower heartbeat_interval"
            )
        if timeout is None:
            return
        if self.heartbeat_interval is not None and timeout <= interval:  # both set
            raise ConfigError(
                f"heartbeat_timeout ({timeout}) must be greater than "
                f"heartbeat_interval ({interval}): raise heartbeat_timeout"
            )
        warnings.warn(
            f"heartbeat_timeout ({timeout}) is ignored: a lost rank is detected by its "
            "watchdog (process death) or by hard_timeout; drop the option",
            UserWarning,
            stacklevel=4,
        )

    def validate_world(self, world_size: int) -> None:
        """Check the values that depend on the job's size (called once the world is known)."""
        if self.active_world_size is not None and self.active_world_size > world_size:
            raise ConfigError(
                f"active_world_size ({self.active_world_size}) must be <= WORLD_SIZE "
                f"({world_size}): lower active_world_size or start more ranks"
            )
        if self.min_active_world_size > world_size:
            raise ConfigError(
                f"min_active_world_size ({self.min_active_world_size}) must be <= WORLD_SIZE "
                f"({world_size}): lower min_active_world_size or start more ranks"
            )


def _positive(name: str, value: Any) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not (value > 0) or math.isinf(value):
        raise ConfigError(
            f"{name} ({value!r}) must be a finite number of seconds > 0: give a positive duration"
        )


def _positive_int(name: str, value: Any, *, none_ok: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        hint = " or None" if none_ok else ""
        raise ConfigError(
            f"{name} ({value!r}) must be an integer >= 1{hint}: give a positive count"
        )
