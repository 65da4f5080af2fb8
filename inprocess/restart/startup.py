"""Bringing one rank up before its first iteration: the store, its services, its watchdog.

Called by the restart loop (``inprocess.restart.loop``) on the main thread, once per process, in
this order: ``store_url`` (constructor), ``freeze_gc``, ``connect_store``, ``rank_services``,
``health_checker``, ``new_watchdog``. The loop owns (and closes) everything these return.
"""

from __future__ import annotations

import functools
import gc
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from restartable.checkpoint.sealing import Sealer
from restartable.inprocess.clock import SYSTEM, Clock
from restartable.inprocess.config import RestartConfig
from restartable.inprocess.errors import ConfigError
from restartable.inprocess.etcd.connect import open_store
from restartable.inprocess.etcd.url import parse_url
from restartable.inprocess.protocol.environment import LaunchEnv, store_setting
from restartable.inprocess.protocol.reach import unreachable
from restartable.inprocess.protocol.sealed_store import seal
from restartable.inprocess.protocol.store import Store
from restartable.inprocess.restart.abort import GroupReaper
from restartable.inprocess.restart.health import HealthChecker
from restartable.inprocess.restart.interrupter import Interrupter
from restartable.inprocess.restart.progress import ProgressTracker
from restartable.inprocess.restart.rendezvous import Rendezvous, advertised_host
from restartable.inprocess.restart.services import ClientPool, RankServices
from restartable.inprocess.store_server import client, connect
from restartable.inprocess.timeouts.sections import section_clock

if TYPE_CHECKING:  # imported at run time in new_watchdog only (see there)
    from restartable.inprocess.watchdog_owner import Watchdog

log = logging.getLogger(__name__)


def store_url(cfg: RestartConfig, env: LaunchEnv) -> str | None:
    """The etcd store (docs/etcd.md) when the config or INPROCESS_STORE names one, else None
    (the TCPStore). Raises ``ConfigError`` for timeouts the store cannot serve and for a URL
    none of whose hosts resolves (at once, not after ``barrier_timeout`` of retries); warns
    when the launcher cannot see the store the config names."""
    url = store_setting(cfg.store, env)
    if url is None:
        return None
    source = "INPROCESS_STORE" if cfg.store is None else "store="
    why = unreachable(parse_url(url).endpoints)
    if why is not None:
        raise ConfigError(
            f"{source} ({url}): no endpoint's host resolves ({why}): correct the host names "
            "(docs/etcd.md)"
        )
    if cfg.store is None:
        cfg.check_store_timeouts(url, source="INPROCESS_STORE")
    if cfg.store is not None and env.launcher_pid is not None and not env.store_url:
        log.warning(
            "store=%r is set but restartable.inprocess.launch was started without --store: the "
            "launcher cannot see this job's keys (respawn and in-job restart will not work); "
            "give the launcher --store %s",
            cfg.store,
            cfg.store,
        )
    return url


def freeze_gc(cfg: RestartConfig, me: int, *, clock: Clock = SYSTEM) -> None:
    """``freeze_gc``: collect, then freeze every object that exists now out of later
    collections. Before connecting: for a respawned process, before it is a ready reserve,
    so the 0.1-0.3 s this takes is never on a restart's path."""
    if not cfg.freeze_gc or not gc.isenabled():
        return
    # A full collection walks every object, torch's modules included (0.1-0.14 s here,
    # measured with gc.callbacks). One that fell between a fault and the next train() made
    # each restart wait for it: benchmarks/store_etcd.py's TCPStore restart took 0.20-0.31
    # s instead of 0.03 s in 12 of 12 runs of one build, 0.03 s in 4 of 4 with this.
    # Collected first, so no garbage of the start-up is kept forever.
    t0 = clock.monotonic()
    gc.collect()
    gc.freeze()
    log.debug(
        "rank %d: froze %d objects in %.3f s", me, gc.get_freeze_count(), clock.monotonic() - t0
    )


def connect_store(
    cfg: RestartConfig, env: LaunchEnv, url: str | None, sealer: Sealer | None
) -> tuple[Store, Callable[[], Store]]:
    """This rank's main store client and a factory of further clients, all sealed with the
    job's secret (docs/security.md). Blocks on the connect (bounded by ``barrier_timeout``)."""
    new_raw: Callable[[], Any]
    if url is not None:
        new_raw = functools.partial(open_store, url, job_id=env.job_id, timeout=cfg.barrier_timeout)
        store = seal(new_raw(), sealer)
    else:
        new_raw = functools.partial(
            client, env.master_addr, env.master_port, timeout=cfg.barrier_timeout
        )
        store = seal(connect(env, timeout=cfg.barrier_timeout), sealer)

    def new_client() -> Store:
        return seal(new_raw(), sealer)

    return store, new_client


def advertise(url: str | None) -> str:
    """The host this rank advertises for its groups' stores on etcd ("" on the TCPStore)."""
    return "" if url is None else advertised_host(parse_url(url).endpoints)


def rank_services(
    cfg: RestartConfig,
    env: LaunchEnv,
    *,
    me: int,
    store: Store,
    new_client: Callable[[], Store],
    reaper: GroupReaper,
    url: str | None,
    clock: Clock = SYSTEM,
    end_client: Callable[[], Store] | None = None,
) -> RankServices:
    """What the loop lends to every iteration of this rank (opens one more store client);
    ``url``: the etcd store's, None on the TCPStore; ``clock``: the loop's, for every
    iteration's waits and timings; ``end_client``: where the monitors wait for the end of an
    iteration (the restart by node: the node store, ``NodePath.new_client``; None: the job's
    store, ``new_client``)."""
    return RankServices(
        config=cfg,
        me=me,
        local_rank=env.local_rank,
        store=store,
        # Monitors record soft timeouts on their own client: the main thread's may be busy.
        report_store=new_client(),
        new_client=new_client,
        progress=ProgressTracker(clock=clock),
        interrupter=Interrupter(),
        abort=reaper.abort,
        release=reaper.release,
        sections=section_clock(cfg),  # learned timeouts outlive iterations
        clients=ClientPool(end_client or new_client),
        rendezvous=Rendezvous(
            store,
            me=me,
            hosted=url is not None,
            advertise=advertise(url),
            timeout=cfg.barrier_timeout,
        ),
        clock=clock,
    )


def health_checker(cfg: RestartConfig) -> HealthChecker:
    """This rank's health checks (``inprocess.restart.health``), run between iterations."""
    return HealthChecker(user_checks=cfg.health_checks, empty_cuda_cache=cfg.empty_cuda_cache)


def new_watchdog(
    cfg: RestartConfig, env: LaunchEnv, *, me: int, url: str | None, sealer: Sealer | None
) -> Watchdog:
    """This rank's watchdog (``inprocess.watchdog.Watchdog``), not started yet."""
    # Imported here: `python -m restartable.inprocess.watchdog` imports this package first, and
    # runpy
    # warns when the module it is about to run was already imported by the package.
    from restartable.inprocess.watchdog_owner import Watchdog

    return Watchdog(
        store_host=env.master_addr,
        store_port=env.master_port,
        store_url=url,
        job_id=env.job_id,
        initial_rank=me,
        hard_timeout=cfg.hard_timeout,
        termination_grace_time=cfg.termination_grace_time,
        heartbeat_interval=cfg.effective_heartbeat_interval,
        logdir=cfg.monitor_process_logdir,
        secret=sealer.secret if sealer is not None else None,
    )
