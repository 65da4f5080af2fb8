"""``Timeouts``: the durations of the fault and restart path, one value object.

``RestartConfig`` keeps them here (``cfg.timeouts``) while its keyword arguments and attributes
keep the names users and the seeds know (``soft_timeout=...``, ``cfg.hard_timeout``): each of
those is a ``TimeoutField``, a descriptor that reads and writes this object. Code that needs
the durations together (the monitor, the watchdog, the barriers) takes a ``Timeouts``.
The rules they obey are checked by ``inprocess.config_checks`` when the config is built.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Generic, TypeVar

# NVIDIA's default heartbeat interval; a shorter hard_timeout shortens it (a third of it).
_HEARTBEAT_INTERVAL_CAP = 30.0
# The default bound of a restart decision's wait for respawns: a cold start of a rank (python,
# torch, the script, its watchdog) took 4-7 s on a loaded 2-core host (issue 35).
_RESPAWN_WAIT_CAP = 10.0


@dataclass(frozen=True, kw_only=True)
class Timeouts:
    """The durations (seconds) ``RestartConfig`` documents under the same names. Not checked
    here: ``RestartConfig(...)`` checks them (``inprocess.config_checks``)."""

    soft_timeout: float = 60.0
    hard_timeout: float = 90.0
    heartbeat_interval: float | None = None
    heartbeat_timeout: float | None = None
    barrier_timeout: float = 120.0
    respawn_wait_timeout: float | None = None
    completion_timeout: float = 120.0
    termination_grace_time: float = 1.0

    @property
    def effective_heartbeat_interval(self) -> float:
        """``heartbeat_interval``, or ``min(30, hard_timeout / 3)`` when unset.

        Derived here rather than stored, so ``dataclasses.replace(cfg, hard_timeout=...)``
        derives it again instead of keeping a value the user never set.
        """
        if self.heartbeat_interval is not None:
            return self.heartbeat_interval
        return min(_HEARTBEAT_INTERVAL_CAP, self.hard_timeout / 3)

    @property
    def effective_respawn_wait_timeout(self) -> float:
        """``respawn_wait_timeout``, or ``min(10, barrier_timeout / 2)`` when unset."""
        if self.respawn_wait_timeout is not None:
            return self.respawn_wait_timeout
        return min(_RESPAWN_WAIT_CAP, self.barrier_timeout / 2)


TIMEOUT_NAMES = tuple(f.name for f in fields(Timeouts))
_PENDING = "_timeouts_pending"  # the values the dataclass's __init__ set, until they are grouped
T = TypeVar("T")


class TimeoutField(Generic[T]):
    """A config field (a dataclass field of the same name) whose value lives in the config's
    ``timeouts``; its default is the class-level value (``dataclasses``' descriptor fields).

    Written only by the config's generated ``__init__`` (the config is frozen): the values wait
    in the instance until ``group_timeouts`` (from ``__post_init__``, before any check) builds
    the ``Timeouts``; read from it from then on.
    """

    def __init__(self, default: T) -> None:
        self._default = default
        self._name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        if name not in TIMEOUT_NAMES:
            raise TypeError(f"{owner.__name__}.{name} is not a field of Timeouts")
        self._name = name

    def __get__(self, cfg: object | None, owner: type | None = None) -> T:
        if cfg is None:
            return self._default  # what ``dataclasses`` takes for the field's default
        grouped = cfg.__dict__.get("timeouts")
        if grouped is None:  # inside __init__, before group_timeouts
            value: T = cfg.__dict__[_PENDING][self._name]
            return value
        result: T = getattr(grouped, self._name)
        return result

    def __set__(self, cfg: object, value: T) -> None:
        cfg.__dict__.setdefault(_PENDING, {})[self._name] = value


def group_timeouts(cfg: object) -> None:
    """Build ``cfg.timeouts`` from the values its ``__init__`` set (``__post_init__`` only)."""
    values = cfg.__dict__.pop(_PENDING)
    object.__setattr__(cfg, "timeouts", Timeouts(**values))
