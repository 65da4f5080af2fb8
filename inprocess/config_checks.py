"""The rules a ``RestartConfig`` is checked against when it is built (``inprocess.config``).

Called by ``RestartConfig.__post_init__`` only, in a fixed order (the first broken rule is the
one reported), on the thread that builds the config. Each function raises ``ConfigError`` naming
the field, the value, the rule and the fix. The ones that warn are called directly by
``__post_init__``: their ``stacklevel=4`` points at the code that called ``RestartConfig(...)``.
Two normalise a field of the frozen config in place (``health_checks`` to a tuple,
``rank_section_timeouts`` to a read-only mapping).
"""

from __future__ import annotations

import math
import os
import types
import warnings
from collections.abc import Mapping
from typing import Any

from restartable.inprocess.config_fields import RestartFields
from restartable.inprocess.errors import ConfigError
from restartable.inprocess.timeouts.estimator import SECTIONS

GRANULARITIES = ("rank", "node")
# The fault drill's kinds (Megatron-Bridge's FaultToleranceConfig names; inprocess.faults.drill).
SIMULATED_FAULT_TYPES = ("rank_hung", "rank_killed", "random")
# Smallest soft_timeout with the etcd store: an etcd leader election stalls the store 1-2 s
# (measured, docs/etcd.md), and a main thread blocked in a store call makes no progress.
ETCD_MIN_SOFT_TIMEOUT = 5.0


def timeouts(cfg: RestartFields) -> None:
    """The durations are positive and ``hard_timeout`` outlasts ``soft_timeout``."""
    if cfg.journal_dir is not None and not isinstance(cfg.journal_dir, (str, os.PathLike)):
        raise ConfigError(
            f"journal_dir ({cfg.journal_dir!r}) must be a path or None: pass a directory"
        )
    for name in (
        "soft_timeout",
        "hard_timeout",
        "heartbeat_interval",
        "heartbeat_timeout",
        "barrier_timeout",
        "completion_timeout",
    ):
        value = getattr(cfg, name)
        if value is not None or not name.startswith("heartbeat"):
            positive(name, value)
    if not 0 <= cfg.termination_grace_time < math.inf:  # inf: a hung rank never SIGKILLed
        raise ConfigError(
            f"termination_grace_time ({cfg.termination_grace_time}) must be >= 0 seconds "
            "and finite: give 0 to SIGKILL at once, or a small positive grace"
        )
    if cfg.hard_timeout <= cfg.soft_timeout:
        raise ConfigError(
            f"hard_timeout ({cfg.hard_timeout}) must be greater than soft_timeout "
            f"({cfg.soft_timeout}): raise hard_timeout"
        )


def counts(cfg: RestartFields) -> None:
    """The counts are positive integers and the active world's bounds are in order."""
    for name in ("max_iterations", "active_world_size", "max_rank_faults"):
        value = getattr(cfg, name)
        if value is not None:
            positive_int(name, value, none_ok=True)
    positive_int("min_active_world_size", cfg.min_active_world_size, none_ok=False)
    positive_int("max_same_fault", cfg.max_same_fault, none_ok=False)
    if cfg.active_world_size is not None and cfg.min_active_world_size > cfg.active_world_size:
        raise ConfigError(
            f"min_active_world_size ({cfg.min_active_world_size}) must be <= "
            f"active_world_size ({cfg.active_world_size}): lower min_active_world_size"
        )


def choices(cfg: RestartFields) -> None:
    """``granularity``, ``backend``, ``prewarm`` and ``health_checks`` (made a tuple)."""
    if cfg.granularity not in GRANULARITIES:
        raise ConfigError(
            f"granularity ({cfg.granularity!r}) must be one of {GRANULARITIES}: "
            "use 'rank' to retire one rank per fault or 'node' to retire its node"
        )
    if cfg.backend is not None and (not isinstance(cfg.backend, str) or not cfg.backend):
        raise ConfigError(
            f"backend ({cfg.backend!r}) must be a non-empty backend name: use 'gloo' or "
            "'nccl', or None to pick nccl with CUDA and gloo otherwise"
        )
    if cfg.prewarm is not None and not callable(cfg.prewarm):
        raise ConfigError(f"prewarm ({cfg.prewarm!r}) must be callable or None: pass a function")
    checks = tuple(cfg.health_checks)
    for i, check in enumerate(checks):
        if not callable(check):
            raise ConfigError(
                f"health_checks[{i}] ({check!r}) must be callable: pass functions that "
                "raise when the rank is unhealthy"
            )
    object.__setattr__(cfg, "health_checks", checks)


def flags(cfg: RestartFields) -> None:
    """The boolean switches are bools."""
    for name in ("empty_cuda_cache", "freeze_gc", "init_process_group"):
        value = getattr(cfg, name)
        if not isinstance(value, bool):
            raise ConfigError(
                f"{name} ({value!r}) must be True or False: pass a bool, not a "
                f"{type(value).__name__}"
            )


def drill(cfg: RestartFields) -> None:
    """The fault drill's settings; warns (at the caller of ``RestartConfig(...)``) when
    they are set but the drill is off."""
    if not isinstance(cfg.simulate_fault, bool):
        raise ConfigError(
            f"simulate_fault ({cfg.simulate_fault!r}) must be True or False: True runs the "
            "fault drill (simulated_fault_type, simulated_fault_rank, "
            "simulated_fault_base_delay)"
        )
    if cfg.simulated_fault_type not in SIMULATED_FAULT_TYPES:
        raise ConfigError(
            f"simulated_fault_type ({cfg.simulated_fault_type!r}) must be one of "
            f"{SIMULATED_FAULT_TYPES}: 'rank_killed' sends SIGKILL, 'rank_hung' SIGSTOP, "
            "'random' picks one of them"
        )
    rank = cfg.simulated_fault_rank
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
        raise ConfigError(
            f"simulated_fault_rank ({rank!r}) must be an integer >= 0 (a RANK of the job) "
            "or None: None draws the rank at random"
        )
    delay = cfg.simulated_fault_base_delay
    ok = isinstance(delay, (int, float)) and not isinstance(delay, bool)
    if not ok or not (delay >= 0) or math.isinf(delay):
        raise ConfigError(
            f"simulated_fault_base_delay ({delay!r}) must be a finite number of seconds "
            ">= 0: the drill fires after this delay plus up to as much again"
        )
    if cfg.simulate_fault:
        return
    ignored = [
        f"{name} ({getattr(cfg, name)!r})"
        for name, default in (
            ("simulated_fault_type", "random"),
            ("simulated_fault_rank", None),
            ("simulated_fault_base_delay", 0.0),
        )
        if getattr(cfg, name) != default
    ]
    if ignored:
        warnings.warn(
            f"{', '.join(ignored)} {'is' if len(ignored) == 1 else 'are'} ignored: "
            "simulate_fault is False; set "
            "simulate_fault=True to run the fault drill",
            UserWarning,
            stacklevel=4,
        )


def section_timeouts(cfg: RestartFields) -> None:
    """The section timeouts; warns when ``timeouts_state_path`` is set but nothing is learnt."""
    if not isinstance(cfg.calculate_timeouts, bool):
        raise ConfigError(
            f"calculate_timeouts ({cfg.calculate_timeouts!r}) must be True or False: "
            "True learns section timeouts from observed durations"
        )
    if not isinstance(cfg.rank_section_timeouts, Mapping):
        raise ConfigError(
            f"rank_section_timeouts ({cfg.rank_section_timeouts!r}) must be a mapping of "
            f"section name to seconds, e.g. {{'step': 180.0}}"
        )
    for name, value in cfg.rank_section_timeouts.items():
        if name not in SECTIONS:
            raise ConfigError(
                f"rank_section_timeouts has an unknown section ({name!r}): use one of "
                f"{SECTIONS}; code outside sections is rank_out_of_section_timeout"
            )
        positive(f"rank_section_timeouts[{name!r}]", value)
    # A read-only copy: the frozen config must not change behind the loop's back.
    object.__setattr__(
        cfg,
        "rank_section_timeouts",
        types.MappingProxyType({k: float(v) for k, v in cfg.rank_section_timeouts.items()}),
    )
    if cfg.rank_out_of_section_timeout is not None:
        positive("rank_out_of_section_timeout", cfg.rank_out_of_section_timeout)
    sf = cfg.safety_factor
    ok = isinstance(sf, (int, float)) and not isinstance(sf, bool)
    if not ok or not (sf > 1.0) or math.isinf(sf):
        raise ConfigError(
            f"safety_factor ({sf!r}) must be a finite number > 1: a computed timeout is this "
            "many times the longest duration seen; NVIDIA's default is 5.0"
        )
    path = cfg.timeouts_state_path
    if path is not None and (not isinstance(path, (str, os.PathLike)) or not str(path)):
        raise ConfigError(
            f"timeouts_state_path ({path!r}) must be a file path or None: give e.g. "
            "'runs/x/ft_state.json'"
        )
    if path is not None and not cfg.calculate_timeouts:
        warnings.warn(
            f"timeouts_state_path ({str(path)!r}) is ignored: calculate_timeouts is False; "
            "set calculate_timeouts=True to learn timeouts and keep them in that file",
            UserWarning,
            stacklevel=4,
        )


def store(cfg: RestartFields) -> None:
    """``store`` is an etcd URL whose timeouts hold (``check_store_timeouts``)."""
    if cfg.store is None:
        return
    from restartable.inprocess.etcd.url import parse_url

    try:
        parse_url(cfg.store)
    except ConfigError as exc:
        raise ConfigError(f"store: {exc}") from None
    store_timeouts(cfg, cfg.store, source="store")


def store_timeouts(cfg: RestartFields, url: str, *, source: str) -> None:
    """``soft_timeout`` outlasts an etcd leader election (the store is ``url``, from the
    setting ``source``; ``RestartConfig.check_store_timeouts``)."""
    if cfg.soft_timeout < ETCD_MIN_SOFT_TIMEOUT:
        raise ConfigError(
            f"soft_timeout ({cfg.soft_timeout}) must be >= {ETCD_MIN_SOFT_TIMEOUT} with "
            f"the etcd store ({source}={url!r}): losing the etcd leader stalls every store "
            "call for 1-2 s, which a shorter soft timeout turns into a restart; raise "
            "soft_timeout"
        )


def respawn_wait(cfg: RestartFields) -> None:
    if cfg.respawn_wait_timeout is None:
        return
    if not 0 <= cfg.respawn_wait_timeout < cfg.barrier_timeout:
        raise ConfigError(
            f"respawn_wait_timeout ({cfg.respawn_wait_timeout}) must be >= 0 and below "
            f"barrier_timeout ({cfg.barrier_timeout}): the ranks wait for the decision "
            "at most barrier_timeout; lower respawn_wait_timeout or raise barrier_timeout"
        )


def heartbeat(cfg: RestartFields) -> None:
    """``heartbeat_interval`` below ``hard_timeout``; warns that ``heartbeat_timeout`` is
    ignored."""
    interval, timeout = cfg.timeouts.effective_heartbeat_interval, cfg.heartbeat_timeout
    if interval >= cfg.hard_timeout:  # only a value the user set can fail this
        raise ConfigError(
            f"heartbeat_interval ({interval}) must be less than hard_timeout "
            f"({cfg.hard_timeout}): lower heartbeat_interval"
        )
    if timeout is None:
        return
    if cfg.heartbeat_interval is not None and timeout <= interval:  # both set
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


def positive(name: str, value: Any) -> None:
    """``value`` is a finite number of seconds > 0."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not (value > 0) or math.isinf(value):
        raise ConfigError(
            f"{name} ({value!r}) must be a finite number of seconds > 0: give a positive duration"
        )


def positive_int(name: str, value: Any, *, none_ok: bool) -> None:
    """``value`` is an integer >= 1 (``none_ok``: the hint says None is allowed too)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        hint = " or None" if none_ok else ""
        raise ConfigError(
            f"{name} ({value!r}) must be an integer >= 1{hint}: give a positive count"
        )
