"""``RestartConfig``: every knob of ``@restartable``, validated when it is built."""

from __future__ import annotations

from dataclasses import dataclass

from restartable.inprocess import config_checks
from restartable.inprocess.config_checks import (  # re-exported: restartable.inprocess.config
    ETCD_MIN_SOFT_TIMEOUT,
    GRANULARITIES,
    SIMULATED_FAULT_TYPES,
)
from restartable.inprocess.config_fields import RestartFields
from restartable.inprocess.config_timeouts import group_timeouts
from restartable.inprocess.errors import ConfigError

__all__ = [
    "ETCD_MIN_SOFT_TIMEOUT",
    "GRANULARITIES",
    "SIMULATED_FAULT_TYPES",
    "RestartConfig",
]


@dataclass(frozen=True, kw_only=True)
class RestartConfig(RestartFields):
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
    * ``respawn_wait_timeout``: how long a restart decision that cannot fill the active set
      (it would shrink the job or stop it) waits for the processes the launcher is respawning
      in dead ranks' slots (``inprocess.protocol.capacity``); 0: never wait. Unset (None):
      ``min(10, barrier_timeout / 2)``, which covers a cold start of a rank on a loaded host
      (4-7 s measured; ``effective_respawn_wait_timeout`` is the value in use). Must be below
      ``barrier_timeout`` (the other ranks wait for the decision that long).
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
    * ``freeze_gc``: once, before the first iteration, collect and then ``gc.freeze()`` the
      process's objects (torch's modules and all), so that no later full collection walks
      them: one landing in a restart cost every rank 0.2-0.3 s (see ``inprocess.restart.loop``).
    * ``monitor_process_logdir``: directory for the watchdog processes' logs.
    * ``termination_grace_time``: SIGTERM -> SIGKILL delay of a hard-timeout kill.
    * ``init_process_group`` / ``backend``: create the default process group for the active
      ranks before every call (backend None: nccl with CUDA, else gloo).
    * ``prewarm``: called once on a reserve rank while it waits.
    * ``health_checks``: callables run before every iteration; raising retires the rank.
    * ``rank_section_timeouts``: seconds per section (``ctx.section(name)``; names ``setup``,
      ``step``, ``checkpointing``): a section open longer is a fault of this rank (inside it,
      this also replaces a shorter ``soft_timeout``). ``rank_out_of_section_timeout``: the same
      for code between two sections. Both are upper bounds of the computed values.
    * ``calculate_timeouts``: learn each section's timeout from its observed durations
      (``safety_factor`` x the longest, after a warm-up; see docs/timeouts.md).
    * ``journal_dir``: write the run journal there (one JSONL file per process; see
      docs/journal.md and ``python -m restartable.inprocess.report``). None:
      ``$RESTARTABLE_JOURNAL_DIR``, else no journal.
    * ``store``: the coordination store on an etcd v3 cluster,
      ``"etcd://host1:2379,host2:2379,host3:2379"`` (every endpoint is tried; see docs/etcd.md).
      None: ``$INPROCESS_STORE`` (set by ``inprocess.launch --store``), else the TCPStore at
      MASTER_ADDR:MASTER_PORT. The job's keys live under its job id (``INPROCESS_JOB_ID``,
      ``SLURM_JOB_ID`` or ``TORCHELASTIC_RUN_ID``). Needs ``soft_timeout >= 5`` (losing the etcd
      leader stalls the store for 1-2 s).
    * ``timeouts_state_path``: the ``ft_state.json`` that keeps computed timeouts across
      launches (read at launch and at every restart, written by the active rank 0).
    * ``simulate_fault``: a fault drill (Megatron-Bridge's ``FaultToleranceConfig`` names): once
      per job, ``simulated_fault_base_delay`` plus up to as much again (seconds, at random)
      after every rank met, rank ``simulated_fault_rank`` (the initial RANK; None: one drawn at
      random, the same on every rank) sends itself SIGKILL (``simulated_fault_type`` =
      "rank_killed") or SIGSTOP ("rank_hung": only the hard timeout ends it); "random" picks
      one of the two. Not again after a restart, in a respawned process or in a later round
      of ``inprocess.launch`` (``inprocess.faults.drill``). The launcher has the same drill as
      flags.

    The durations from ``soft_timeout`` to ``termination_grace_time`` are also grouped as
    ``cfg.timeouts`` (``inprocess.config_timeouts.Timeouts``).
    """

    def __post_init__(self) -> None:
        # The rules live in inprocess.config_checks; the order is the order errors are found
        # in. The ones that warn are called from here, so that their stacklevel names the
        # caller of RestartConfig(...).
        group_timeouts(self)  # first: the checks read the durations from cfg.timeouts
        config_checks.timeouts(self)
        config_checks.heartbeat(self)
        config_checks.store(self)
        config_checks.respawn_wait(self)
        config_checks.counts(self)
        config_checks.choices(self)
        config_checks.section_timeouts(self)
        config_checks.drill(self)
        config_checks.flags(self)

    def check_store_timeouts(self, url: str, *, source: str) -> None:
        """``soft_timeout`` must outlast an etcd leader election when the store is ``url``
        (``source`` names the setting it came from: ``store`` or ``INPROCESS_STORE``)."""
        config_checks.store_timeouts(self, url, source=source)

    @property
    def section_limits(self) -> dict[str, float]:
        """The configured upper bounds by key (sections, and ``out_of_section`` when set)."""
        limits = dict(self.rank_section_timeouts)
        if self.rank_out_of_section_timeout is not None:
            limits["out_of_section"] = float(self.rank_out_of_section_timeout)
        return limits

    @property
    def effective_respawn_wait_timeout(self) -> float:
        """``respawn_wait_timeout``, or ``min(10, barrier_timeout / 2)`` when unset."""
        return self.timeouts.effective_respawn_wait_timeout

    @property
    def effective_heartbeat_interval(self) -> float:
        """``heartbeat_interval``, or the value derived from ``hard_timeout`` when unset.

        Derived here rather than stored, so ``dataclasses.replace(cfg, hard_timeout=...)``
        derives it again instead of keeping a value the user never set.
        """
        return self.timeouts.effective_heartbeat_interval

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
        rank = self.simulated_fault_rank
        if self.simulate_fault and rank is not None and rank >= world_size:
            raise ConfigError(
                f"simulated_fault_rank ({rank}) must be < WORLD_SIZE ({world_size}): name a "
                "rank of the job, or None to draw one at random"
            )
