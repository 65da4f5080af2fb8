"""The fields of ``RestartConfig``: every knob of ``@restartable``, its type and default.

Documented, built and checked as ``inprocess.config.RestartConfig`` (this base holds the data
only, so that ``inprocess.config_checks`` can name its type without importing the class that
calls it). The durations of the fault path live in one ``Timeouts`` (``cfg.timeouts``); their
keyword arguments and attributes keep their names (``TimeoutField``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from restartable.inprocess.config_timeouts import TimeoutField, Timeouts


@dataclass(frozen=True, kw_only=True)
class RestartFields:
    """The data of a ``RestartConfig`` (see its docstring for each field's meaning)."""

    # A TimeoutField default is a descriptor, not a shared value (RUF009 does not apply): the
    # dataclass takes its default from it and its __init__ writes through it.
    soft_timeout: TimeoutField[float] = TimeoutField(60.0)  # noqa: RUF009
    hard_timeout: TimeoutField[float] = TimeoutField(90.0)  # noqa: RUF009
    heartbeat_interval: TimeoutField[float | None] = TimeoutField(None)  # noqa: RUF009
    heartbeat_timeout: TimeoutField[float | None] = TimeoutField(None)  # noqa: RUF009
    barrier_timeout: TimeoutField[float] = TimeoutField(120.0)  # noqa: RUF009
    respawn_wait_timeout: TimeoutField[float | None] = TimeoutField(None)  # noqa: RUF009
    completion_timeout: TimeoutField[float] = TimeoutField(120.0)  # noqa: RUF009
    max_iterations: int | None = None
    active_world_size: int | None = None
    min_active_world_size: int = 1
    granularity: str = "rank"
    max_rank_faults: int | None = None
    empty_cuda_cache: bool = True
    freeze_gc: bool = True
    monitor_process_logdir: str | None = None
    termination_grace_time: TimeoutField[float] = TimeoutField(1.0)  # noqa: RUF009
    init_process_group: bool = True
    backend: str | None = None
    max_same_fault: int = 3
    prewarm: Callable[[], Any] | None = None
    health_checks: Sequence[Callable[[], Any]] = field(default_factory=tuple)
    calculate_timeouts: bool = False
    rank_section_timeouts: Mapping[str, float] = field(default_factory=dict)
    rank_out_of_section_timeout: float | None = None
    safety_factor: float = 5.0
    timeouts_state_path: str | os.PathLike[str] | None = None
    journal_dir: str | os.PathLike[str] | None = None
    store: str | None = None
    simulate_fault: bool = False
    simulated_fault_type: str = "random"
    simulated_fault_rank: int | None = None
    simulated_fault_base_delay: float = 0.0
    # Built from the TimeoutFields above by __post_init__ (config_timeouts.group_timeouts).
    timeouts: Timeouts = field(init=False, repr=False, compare=False)
