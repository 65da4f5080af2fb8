"""The one place ``inprocess`` reads launcher environment variables."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from restartable.inprocess.errors import ConfigError


@dataclass(frozen=True)
class LaunchEnv:
    """What the launcher told this rank (torchrun, srun, ``inprocess.launch`` or by hand).

    ``store_hosted``: a store server already listens at MASTER_ADDR:MASTER_PORT
    (``INPROCESS_STORE_HOSTED=1`` from our launcher and test helper, or torchrun's agent store,
    ``TORCHELASTIC_USE_AGENT_STORE=True``); otherwise rank 0 starts a detached server process.
    """

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str
    master_port: int
    store_hosted: bool
    launcher_pid: int | None = None  # set by inprocess.launch (INPROCESS_LAUNCHER_PID)
    # How many times inprocess.launch respawned this rank's slot (INPROCESS_RESPAWN_GENERATION):
    # 0 for the processes started with the job; a respawned process joins as a new reserve.
    respawn_generation: int = 0
    # inprocess.launch's --max-respawns (INPROCESS_MAX_RESPAWNS): whether a lost rank's slot is
    # refilled (the config's drill warns when it loses a rank that nothing replaces).
    max_respawns: int = 0
    # The coordination store on etcd (INPROCESS_STORE, "etcd://h1:2379,..."; None: the TCPStore
    # at MASTER_ADDR:MASTER_PORT) and the job id its keys live under (INPROCESS_JOB_ID, else
    # SLURM_JOB_ID.SLURM_STEP_ID, else TORCHELASTIC_RUN_ID); see docs/etcd.md.
    store_url: str | None = None
    job_id: str | None = None
    # The in-job restart round of inprocess.launch (INPROCESS_LAUNCH_ROUND) or torchrun's
    # restart count (TORCHELASTIC_RESTART_COUNT): 0 for the job's first start.
    launch_round: int = 0
    # This launch's id (``launch_id()``): the journal groups records by it, and the store a
    # rank 0 starts is stamped with it, so that a rank never joins an earlier job's store.
    launch: str | None = None
    # Every rank runs under ``python -m restartable.inprocess.srun_task`` (INPROCESS_TASK=1, which
    # it sets).
    under_task: bool = False

    @property
    def identity(self) -> int:
        """The rank assignment's name for this process: the initial rank for a process started
        with the job, ``rank + generation * world_size`` for a respawned one."""
        return self.rank + self.respawn_generation * self.world_size


def read_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Read RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT (Slurm's SLURM_PROCID,
    SLURM_NTASKS, SLURM_NTASKS_PER_NODE as fallbacks); errors name the missing variable."""
    env = os.environ if environ is None else environ

    def get_int(*names: str, default: int | None = None) -> int:
        for name in names:
            if env.get(name):
                try:
                    return int(env[name].split("(")[0].split(",")[0])
                except ValueError:
                    raise ConfigError(
                        f"{name} ({env[name]!r}) must be an integer: fix the launcher's variables"
                    ) from None
        if default is None:
            raise ConfigError(
                f"{names[0]} is not set: start the job with python -m restartable.launch, torchrun "
                "or srun, or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT"
            )
        return default

    rank = get_int("RANK", "SLURM_PROCID")
    world = get_int("WORLD_SIZE", "SLURM_NTASKS")
    local = get_int("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", default=world)
    if not 0 <= rank < world:
        raise ConfigError(f"RANK ({rank}) must be in [0, WORLD_SIZE={world}): fix RANK")
    if local < 1 or world % local:
        local = world  # uneven nodes: treat the job as one node rather than guess
    hosted = env.get("INPROCESS_STORE_HOSTED") == "1" or (
        env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    )
    return LaunchEnv(
        rank=rank,
        local_rank=get_int("LOCAL_RANK", "SLURM_LOCALID", default=rank % local),
        world_size=world,
        local_world_size=local,
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=get_int("MASTER_PORT"),
        store_hosted=hosted,
        launcher_pid=get_int("INPROCESS_LAUNCHER_PID", default=0) or None,
        respawn_generation=_generation(get_int("INPROCESS_RESPAWN_GENERATION", default=0)),
        max_respawns=max(0, get_int("INPROCESS_MAX_RESPAWNS", default=0)),
        store_url=_store_url(env.get("INPROCESS_STORE", "")),
        job_id=_job_id(env),
        launch_round=get_int("INPROCESS_LAUNCH_ROUND", "TORCHELASTIC_RESTART_COUNT", default=0),
        launch=launch_id(env),
        under_task=env.get(ENV_TASK) == "1",
    )


ENV_LAUNCH = "RESTARTABLE_LAUNCH_ID"  # set by a launcher (or a batch script): one id per attempt
ENV_ATTEMPT = "RESTARTABLE_ATTEMPT"  # set by inprocess.launch: the job's attempt, 0 first
ENV_TASK = "INPROCESS_TASK"  # "1": the rank runs under inprocess.srun_task (which sets it)


def job_attempt(env: Mapping[str, str] | None = None) -> int | None:
    """This attempt of the job (0 first, 1 after one requeue, ...), decided once per job:
    ``RESTARTABLE_ATTEMPT`` (``inprocess.launch`` sets it), else under Slurm
    ``SLURM_RESTART_COUNT`` (Slurm sets it on a requeue; unset means 0); None elsewhere."""
    env = os.environ if env is None else env
    for name in (ENV_ATTEMPT, "SLURM_RESTART_COUNT"):
        if env.get(name, "").strip().isdigit():
            return int(env[name])
    return 0 if env.get("SLURM_JOB_ID") else None


def launch_id(env: Mapping[str, str] | None = None) -> str | None:
    """The id of this launch, the same on every node and different for every attempt of a job:
    ``RESTARTABLE_LAUNCH_ID``, else under Slurm ``slurm-<SLURM_JOB_ID>-<attempt>`` (a requeued
    job keeps its job id: the attempt tells the attempts apart), else None."""
    env = os.environ if env is None else env
    given = env.get(ENV_LAUNCH, "").strip()
    if given:
        return given
    job = env.get("SLURM_JOB_ID", "").strip()
    return f"slurm-{job}-{job_attempt(env)}" if job else None


# Where a job id comes from, first set wins: ours, then the scheduler's or torchrun's.
_JOB_ID_VARS = ("INPROCESS_JOB_ID", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID")


def slurm_job_step(env: Mapping[str, str] | None = None) -> str | None:
    """The id of this Slurm job step as a store namespace: ``<SLURM_JOB_ID>.<SLURM_STEP_ID>``
    (``<SLURM_JOB_ID>`` where no step id is set, as in a batch script); None outside Slurm.

    Two ``srun`` steps of one allocation share the job id: with the step in the namespace the
    second one's start never deletes the first one's keys. A requeued job runs its steps with
    the same ids again, so its stale keys are still found and deleted (``inprocess.launch``)."""
    env = os.environ if env is None else env
    job = env.get("SLURM_JOB_ID", "").strip()
    if not job:
        return None
    step = env.get("SLURM_STEP_ID", "").strip()
    return f"{job}.{step}" if step.isdigit() else job


def _job_id(env: Mapping[str, str]) -> str | None:
    for name in _JOB_ID_VARS:
        value = env.get(name, "").strip()
        if name == "SLURM_JOB_ID" and value:
            return slurm_job_step(env)
        # torchrun's --rdzv-id defaults to "none": shared by every job, so not an id.
        if value and not (name == "TORCHELASTIC_RUN_ID" and value == "none"):
            return value
    return None


def _store_url(value: str) -> str | None:
    """INPROCESS_STORE checked with the etcd URL parser (empty: the default TCPStore)."""
    value = value.strip()
    if not value:
        return None
    from restartable.inprocess.etcd.url import parse_url

    try:
        parse_url(value)
    except ConfigError as exc:
        raise ConfigError(f"INPROCESS_STORE ({value!r}) is not a store URL: {exc}") from None
    return value


def store_setting(config_store: str | None, env: LaunchEnv) -> str | None:
    """The store URL in use: the config's ``store=`` wins over INPROCESS_STORE; None: TCPStore.

    With etcd, checks that the job has an id (the URL's path, INPROCESS_JOB_ID, SLURM_JOB_ID or
    TORCHELASTIC_RUN_ID); raises ``ConfigError`` otherwise, before anything connects.
    """
    url = config_store or env.store_url
    if url is None:
        return None
    from restartable.inprocess.etcd.connect import job_prefix
    from restartable.inprocess.etcd.url import check_job_id

    if env.job_id is not None:
        where = "the job id (INPROCESS_JOB_ID, SLURM_JOB_ID or TORCHELASTIC_RUN_ID)"
        check_job_id(env.job_id, where=where, round_suffix=True)
    job_prefix(url, env.job_id)
    return url


def _generation(value: int) -> int:
    if value < 0:
        raise ConfigError(
            f"INPROCESS_RESPAWN_GENERATION ({value}) must be >= 0: it is set by the launcher; "
            "unset it when starting a rank by hand"
        )
    return value


_PR_SET_PDEATHSIG = 1


def bind_to_launcher(launcher_pid: int) -> None:
    """Make this rank die with ``inprocess.launch`` (Linux; a no-op elsewhere).

    The launcher hosts the store and relays the ranks' output: once it is gone (SIGKILLed, its
    node lost) its ranks can never finish, and left alone they would wait forever as orphans.
    The kernel delivers SIGKILL to this process when its parent exits. Raises ``ConfigError``
    when the launcher is already gone.
    """
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return  # not fatal: only the orphan protection is lost
    if os.getppid() != launcher_pid:  # it died before the prctl took effect
        raise ConfigError(
            f"the launcher (pid {launcher_pid}) is gone: this rank cannot join its job"
        )
