"""What one rank of a ``@restartable`` call starts and must release, whatever happens.

Owned by the restart loop (``inprocess.restart.loop``), on the main thread: ``RankLifetime`` is
built with the loop, ``open()`` brings the rank up once before its first iteration, and
``close()`` releases everything once, in whatever state the loop stopped. Bringing each piece up
is ``inprocess.restart.startup``'s; the goodbye in the store is ``inprocess.restart.leaving``'s.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from restartable.checkpoint.sealing import job_sealer
from restartable.inprocess import journal
from restartable.inprocess.clock import Clock
from restartable.inprocess.config import RestartConfig
from restartable.inprocess.faults import drill
from restartable.inprocess.protocol import barriers, job_keys
from restartable.inprocess.protocol.environment import LaunchEnv
from restartable.inprocess.protocol.ranks import Assignment
from restartable.inprocess.protocol.store import Store
from restartable.inprocess.restart import joining, startup
from restartable.inprocess.restart.abort import GroupReaper, abort_process_groups
from restartable.inprocess.restart.health import HealthChecker
from restartable.inprocess.restart.leaving import close_quietly, leave_store
from restartable.inprocess.restart.node_path import NodePath
from restartable.inprocess.restart.restored import TierBoard
from restartable.inprocess.restart.services import RankServices
from restartable.inprocess.restart.story import RestartStory
from restartable.inprocess.restart.warmup import FirstUseImports

if TYPE_CHECKING:  # imported at run time by startup.new_watchdog only (see there)
    from restartable.inprocess.watchdog_owner import Watchdog


class RankLifetime:
    """The resources of one rank: the store and its clients, the services lent to every
    iteration (``svc``), the watchdog, the health checker, the groups' reaper, the restart line
    (``story``), the fault drill, a reserve's first-use imports and the journal.

    Built by the loop's constructor (resolves the store's URL, which may raise ``ConfigError``,
    then opens the journal); ``open()`` once (blocks on the connect and the initial barrier, each
    bounded by ``barrier_timeout``); ``close(outcome)`` once the loop ended (idempotent).
    """

    def __init__(self, cfg: RestartConfig, env: LaunchEnv, *, me: int, clock: Clock) -> None:
        self.cfg, self.env, self.me, self.clock = cfg, env, me, clock
        self.store_url = startup.store_url(cfg, env)
        self._store: Store | None = None  # connected by open()
        self._watchdog: Watchdog | None = None  # started by open()
        self.health: HealthChecker | None = None
        self.svc: RankServices | None = None
        # A reserve's imports of what DDP / FSDP2 need first (inprocess.restart.warmup).
        self.first_use = FirstUseImports(clock=clock)
        self.reaper = GroupReaper(rank=me, clock=clock)
        self.story = RestartStory(clock=clock)
        self.drill: drill.RankDrill | None = None  # the config's simulate_fault
        self.closed = False
        directory = journal.resolve_dir(cfg.journal_dir)
        self.journal = None if directory is None else journal.open_journal(directory, rank=me)
        # --restart-by node: the node's store and layout; None: the per-rank restart barrier.
        self.node = NodePath.of_rank(os.environ, env, cfg.barrier_timeout, clock, sealer=job_sealer)

    def open(self, *, joining_job: bool) -> int:
        """Connect, start the services and the watchdog, and meet every rank once (the initial
        barrier) or, for a process the launcher respawned (``joining_job``), register it.

        Returns the iteration announced when it registered (0 when not joining).
        """
        cfg, env = self.cfg, self.env
        startup.freeze_gc(cfg, self.me, clock=self.clock)
        registered_at = self._connect(joining_job)
        # inprocess.launch's side: its journal joins this one (respawns and in-job restarts in
        # the report), and the config's fault drill starts, once per job (inprocess.faults.drill).
        job_keys.publish_journal_dir(self.store, self.journal)
        self.drill = drill.start_in_rank(cfg, env, self.store)
        return registered_at

    def _connect(self, joining_job: bool) -> int:
        cfg, env = self.cfg, self.env
        # Every value this process writes to the store is sealed with the job's secret (from
        # inprocess.launch, or made by the first process of the job: docs/security.md).
        sealer = job_sealer()
        store, new_client = startup.connect_store(cfg, env, self.store_url, sealer)
        self._store = store
        svc = self.svc = startup.rank_services(
            cfg,
            env,
            me=self.me,
            store=store,
            new_client=new_client,
            reaper=self.reaper,
            url=self.store_url,
            clock=self.clock,
            end_client=None if self.node is None else self.node.new_client,
        )
        self.health = startup.health_checker(cfg)
        self._watchdog = watchdog = startup.new_watchdog(
            cfg, env, me=self.me, url=self.store_url, sealer=sealer
        )
        if joining_job:
            return joining.register(self.store, watchdog, me=self.me)
        watchdog.start()
        with svc.progress.paused():
            barriers.initial_barrier(
                self.store,
                world_size=env.world_size,
                timeout=cfg.barrier_timeout,
                clock=self.clock,
            )
        return 0

    @property
    def is_open(self) -> bool:
        """Whether ``open()`` connected the store (it may have failed after that)."""
        return self._store is not None

    @property
    def store(self) -> Store:
        """This rank's main store client (after ``open()``: a programming error before)."""
        if self._store is None:
            raise RuntimeError("RankLifetime.store read before open() connected it")
        return self._store

    @property
    def watchdog(self) -> Watchdog:
        """This rank's watchdog (after ``open()``: a programming error before)."""
        if self._watchdog is None:
            raise RuntimeError("RankLifetime.watchdog read before open() created it")
        return self._watchdog

    def announce(self, iteration: int, assignment: Assignment) -> None:
        """Tell the watchdog and the store that ``iteration`` starts with ``assignment`` (the
        loop, at the start of each iteration; one store write, never blocks)."""
        # A reserve's death only marks it gone: it never interrupts the training (issue 35).
        self.watchdog.set_iteration(iteration, reserve=assignment.rank_of(self.me) is None)
        job_keys.start_iteration(
            self.store,
            iteration,
            participants=len(assignment.active) + len(assignment.reserve),
            reserves=assignment.reserve,
            by_node=self.node is not None,
        )
        if self.node is not None:
            self.node.announce(iteration, assignment.active + assignment.reserve)

    def tier_board(self, iteration: int, active: tuple[int, ...]) -> TierBoard:
        """The board on which the active ranks of ``iteration`` (after a restart) say which tier
        they restored from (``inprocess.restart.restored``), over this rank's store clients."""
        assert self.svc is not None
        return TierBoard(
            self.svc.store,
            self.svc.new_client,
            iteration=iteration,
            me=self.me,
            active=active,
            clock=self.clock,
        )

    def close(self, outcome: str) -> None:
        """Release everything this rank started (idempotent; the watchdog stops silently).
        ``outcome``: the journal's ``job_end`` ("done", "stopped" or "failed")."""
        if self.closed:
            return
        self.closed = True
        if self.drill is not None:
            self.drill.close()
        abort_process_groups()
        self.reaper.close(timeout=self.cfg.hard_timeout)
        self.story.close()
        svc = self.svc
        owners = (
            (svc.interrupter, svc.progress, svc.rendezvous, svc.clients) if svc is not None else ()
        )
        close_quietly(*owners, self._watchdog, self.health, self.first_use)
        if self._store is not None:
            leave_store(
                self._store,
                me=self.me,
                world_size=self.env.world_size,
                # Only on etcd and without inprocess.launch (whose processes still read the
                # keys; it deletes them itself) does the last rank out delete the job's keys.
                owns_cleanup=self.store_url is not None and self.env.launcher_pid is None,
                # EtcdStore clients hold HTTP connections
                close=(self._store, svc.report_store if svc is not None else None)
                if self.store_url is not None
                else (),
            )
        if self.journal is not None:  # last: the job's end includes this clean-up
            journal.record("job_end", outcome=outcome)
            self.journal.close()
