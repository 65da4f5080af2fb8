"""``@restartable``: the restart loop, run as a flat sequence of named phases per iteration.

Per rank: connect -> initial barrier -> assign ranks, then for each iteration:
join (active) or wait (reserve) -> train() -> completion, and on a fault:
unwind -> abort -> health check -> restart barrier (one decision wins) -> next iteration.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, TypeVar, overload

from checkpoint.sealing import ForgedValueError, job_sealer
from inprocess import journal
from inprocess.clock import SYSTEM
from inprocess.config import RestartConfig
from inprocess.context import RestartRecord
from inprocess.errors import ConfigError, RestartAbortedError, StoreTimeoutError
from inprocess.faults import drill
from inprocess.protocol import barriers, job_keys
from inprocess.protocol.environment import bind_to_launcher, read_env
from inprocess.protocol.policy import Decision
from inprocess.protocol.ranks import Assignment, initial_assignment, node_of_ranks
from inprocess.restart import joining, startup, torchrun_env
from inprocess.restart.abort import GroupReaper, abort_process_groups
from inprocess.restart.active import Outcome, RankServices, run_active
from inprocess.restart.advice import KillAdvice
from inprocess.restart.agreement import RestartAgreement
from inprocess.restart.health import HealthChecker, check_and_report
from inprocess.restart.leaving import close_quietly, leave_store
from inprocess.restart.process_group import check_no_default_group
from inprocess.restart.reserve import wait_as_reserve
from inprocess.restart.restored import TierBoard
from inprocess.restart.story import RestartStory
from inprocess.restart.warmup import FirstUseImports

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])


@overload
def restartable(fn: F, /) -> F: ...
@overload
def restartable(
    fn: None = None, /, *, config: RestartConfig | None = None, **options: Any
) -> Callable[[F], F]: ...
def restartable(
    fn: Callable[..., Any] | None = None, /, *, config: RestartConfig | None = None, **options: Any
) -> Any:
    """Decorate ``train()`` so that a fault on any rank re-runs it on every rank, in place.

    ``@restartable``, ``@restartable(soft_timeout=..., ...)`` or
    ``@restartable(config=RestartConfig(...))``; the keywords are ``RestartConfig``'s fields.
    Calling the decorated function runs the restart loop and returns ``train()``'s result on the
    active ranks and None on reserves. Raises ``RestartAbortedError`` (every rank, same message)
    when the job stops restarting.
    """
    if config is not None and options:
        raise ConfigError(
            f"restartable got config= and keyword options {sorted(options)}: pass one of them "
            "(RestartConfig(...) takes the same keywords)"
        )
    if config is None:
        try:
            config = RestartConfig(**options)
        except TypeError as exc:
            raise ConfigError(
                f"restartable: {exc}: the options are the fields of RestartConfig"
            ) from None
    cfg = config

    def decorate(f: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(f)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with _Job(cfg, f) as job:
                return job.run(args, kwargs)

        wrapper.config = cfg  # type: ignore[attr-defined]
        return wrapper

    return decorate(fn) if fn is not None else decorate


@dataclass(frozen=True)
class _PendingRestart:
    """A restart decided but not yet logged: logged once the next iteration's group exists."""

    decision: Decision
    before: Assignment
    after: Assignment
    phases: dict[str, float]  # detect, abort, unwind, barrier (seconds)
    fault_time: float = 0.0  # time.time() of the first fault (the console line's seconds)

    def record(self, *, reinit_s: float) -> RestartRecord:
        d = self.decision
        return RestartRecord(
            iteration=d.iteration + 1,
            cause=d.cause(),
            faulting_ranks=d.faulting_ranks,
            phases={**self.phases, "reinit": reinit_s},
            active_before=self.before.active,
            active_after=self.after.active,
            reserve_after=self.after.reserve,
        )

    @classmethod
    def of(
        cls, decision: Decision, *, before: Assignment, out: Outcome, t_barrier: float
    ) -> _PendingRestart:
        """The restart ``decision`` (which has an assignment) took after the iteration that
        ended with ``out``; the restart barrier began at ``t_barrier`` (time.monotonic())."""
        assert decision.assignment is not None  # RestartAgreement.meet raised otherwise
        first = min((f.time for f in decision.faults if f.time), default=out.noticed)
        return cls(
            decision=decision,
            before=before,
            after=decision.assignment,
            phases={
                "detect": max(0.0, out.noticed - first),
                "abort": out.abort_s,
                "unwind": out.unwind_s,
                "barrier": time.monotonic() - t_barrier,
            },
            fault_time=first,
        )

    def log(self, *, me: int, reinit_s: float) -> RestartRecord:
        """Journal and log this restart once (``inprocess.restart.loop: restart {...}``); returns
        its record. DEBUG: every rank writes it, and the console's INFO line of a restart is
        the new rank 0's (``inprocess.restart.story``); the journal has the same record."""
        record = self.record(reinit_s=reinit_s)
        journal.record("restart", **asdict(record))
        log.debug(
            "restart %s",
            json.dumps({**asdict(record), "rank": me}, sort_keys=True),
            extra={"restart": asdict(record), "rank": me, "iteration": record.iteration},
        )
        for c in self.decision.collateral:
            log.debug("not counted: rank %d %s: %s", c.fault.initial_rank, c.fault.kind, c.reason)
        return record


class _Job:
    """One call of a ``@restartable`` function on one rank: owns every resource of the loop.

    ``run()`` is the loop; each iteration is a sequence of named phases (``_active_phase`` or
    ``_reserve_phase``, then on a fault ``_health_phase`` and ``_restart_phase``). ``close()``
    releases everything, whatever state the loop stopped in. Bringing the rank up is
    ``inprocess.restart.startup``'s, a reserve's iteration ``inprocess.restart.reserve``'s, the
    restart barrier and its decision ``inprocess.restart.agreement``'s.
    """

    def __init__(self, cfg: RestartConfig, fn: Callable[..., Any]) -> None:
        self.cfg, self.fn = cfg, fn
        self.env = read_env()
        if self.env.launcher_pid is not None:
            bind_to_launcher(self.env.launcher_pid)
        cfg.validate_world(self.env.world_size)
        if cfg.init_process_group:
            check_no_default_group()
        self.store_url = startup.store_url(cfg, self.env)
        # A process the launcher respawned joins under a new identity (inprocess.protocol.ranks).
        self.me = self.env.identity
        self.joining = self.env.respawn_generation > 0
        self.registered_at = 0  # a respawned process: the iteration announced when it registered
        self.node_of = node_of_ranks(
            world_size=self.env.world_size, local_world_size=self.env.local_world_size
        )
        self.store: Any = None
        self.watchdog: Any = None  # inprocess.watchdog.Watchdog
        self.health: HealthChecker | None = None
        self.svc: RankServices | None = None
        # Every fault of every restart (for the stop error) and what each restart blamed.
        self.agreement = RestartAgreement(cfg, me=self.me, node_of=self.node_of)
        self.last_restart: RestartRecord | None = None
        self.prewarmed = False
        # A reserve's imports of what DDP / FSDP2 need first (inprocess.restart.warmup).
        self.first_use = FirstUseImports()
        self.advice: KillAdvice | None = KillAdvice()  # None once started (restart.advice)
        self.closed = False
        self.reaper = GroupReaper(rank=self.me)
        self.story = RestartStory()
        self.drill: drill.RankDrill | None = None  # the config's simulate_fault
        self.outcome = "failed"  # "done" / "stopped" once run() knows (the journal's job_end)
        directory = journal.resolve_dir(cfg.journal_dir)
        self.journal = None if directory is None else journal.open_journal(directory, rank=self.me)

    # ----- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> _Job:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release everything this rank started (idempotent; the watchdog stops silently)."""
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
        close_quietly(*owners, self.watchdog, self.health, self.first_use)
        if self.store is not None:
            leave_store(
                self.store,
                me=self.me,
                world_size=self.env.world_size,
                # Only on etcd and without inprocess.launch (whose processes still read the
                # keys; it deletes them itself) does the last rank out delete the job's keys.
                owns_cleanup=self.store_url is not None and self.env.launcher_pid is None,
                # EtcdStore clients hold HTTP connections
                close=(self.store, svc.report_store if svc is not None else None)
                if self.store_url is not None
                else (),
            )
        if self.journal is not None:  # last: the job's end includes this clean-up
            journal.record("job_end", outcome=self.outcome)
            self.journal.close()

    def _start(self) -> RankServices:
        """Connect, start the watchdog and meet every rank once (the initial barrier)."""
        cfg, env = self.cfg, self.env
        # Every value this process writes to the store is sealed with the job's secret (from
        # inprocess.launch, or made by the first process of the job: docs/security.md).
        sealer = job_sealer()
        self.store, new_client = startup.connect_store(cfg, env, self.store_url, sealer)
        svc = self.svc = startup.rank_services(
            cfg,
            env,
            me=self.me,
            store=self.store,
            new_client=new_client,
            reaper=self.reaper,
            url=self.store_url,
        )
        self.health = startup.health_checker(cfg)
        self.watchdog = startup.new_watchdog(
            cfg, env, me=self.me, url=self.store_url, sealer=sealer
        )
        if self.joining:
            self.registered_at = joining.register(self.store, self.watchdog, me=self.me)
            return svc
        self.watchdog.start()
        with svc.progress.paused():
            barriers.initial_barrier(
                self.store,
                world_size=env.world_size,
                timeout=cfg.barrier_timeout,
                clock=SYSTEM,
            )
        return svc

    # ----- the loop --------------------------------------------------------------------------

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The restart loop: returns ``train()``'s value (None on a reserve or retired rank).

        When the loop gives up (``RestartAbortedError``, a barrier timeout) it says so in the
        store first, so that ``inprocess.launch`` restarts the job in place.
        """
        journal.record(
            "job_start",
            world_size=self.env.world_size,
            node=self.node_of[self.env.rank],
            respawn_generation=self.env.respawn_generation,
        )
        try:
            value = self._run(args, kwargs)
            self.outcome = "done"
            return value
        # A value that fails to verify where the restart path reads (a forged fault list or
        # decision) stops the job like a give-up, naming the key: the launcher decides.
        except (RestartAbortedError, StoreTimeoutError, ForgedValueError) as exc:
            self.outcome = "stopped"
            if self.store is not None:
                job_keys.mark_stopped(
                    self.store, str(getattr(exc, "reason", exc)), origin=getattr(exc, "origin", "")
                )
            raise

    def _run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        startup.freeze_gc(self.cfg, self.me)
        self._start()
        # inprocess.launch's side: its journal joins this one (respawns and in-job restarts in
        # the report), and the config's fault drill starts, once per job (inprocess.faults.drill).
        job_keys.publish_journal_dir(self.store, self.journal)
        self.drill = drill.start_in_rank(self.cfg, self.env, self.store)
        assignment = initial_assignment(
            world_size=self.env.world_size,
            node_of=self.node_of,
            active_world_size=self.cfg.active_world_size,
            granularity=self.cfg.granularity,
        )
        target = len(assignment.active)
        iteration = 0
        if self.joining:
            admitted = joining.admit(
                self.store,
                self.watchdog,
                self.agreement,
                self.cfg,
                me=self.me,
                slot=self.env.rank,
                since=self.registered_at,
            )
            if admitted is None:
                return None  # the job finished before a restart needed this process
            iteration, assignment = admitted.iteration, admitted.assignment
        pending: _PendingRestart | None = None  # the restart being completed, logged once
        while True:
            out = self._iteration(iteration, assignment, pending, args, kwargs)
            if out.done:
                return out.value
            # Checked now, before the barrier, so an unhealthy rank is retired by this restart's
            # decision instead of costing another restart at the start of the next iteration.
            self._health_phase(iteration)
            pending = self._restart_phase(iteration, assignment, target, out)
            if self.me in pending.after.retired:
                self._log_restart(pending, reinit_s=0.0)
                log.warning(
                    "rank %d retired after iteration %d (%s); it leaves the job",
                    self.me,
                    iteration,
                    pending.decision.cause(),
                )
                return None
            assignment = pending.after
            iteration += 1

    def _iteration(
        self,
        iteration: int,
        assignment: Assignment,
        pending: _PendingRestart | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Outcome:
        """Announce ``iteration``, then run it in this rank's role (active or reserve)."""
        # A reserve's death only marks it gone: it never interrupts the training (issue 35).
        self.watchdog.set_iteration(iteration, reserve=assignment.rank_of(self.me) is None)
        job_keys.start_iteration(
            self.store,
            iteration,
            participants=len(assignment.active) + len(assignment.reserve),
            reserves=assignment.reserve,
        )
        if iteration == 0:
            self._health_phase(iteration)  # later: right after each fault, in _run
        rank = assignment.rank_of(self.me)
        if self.journal is not None:
            self.journal.set_position(iteration=iteration, training_rank=rank)
            journal.record("iteration_start", active=rank is not None)
        if rank is not None:
            return self._active_phase(iteration, assignment, rank, pending, args, kwargs)
        if pending is not None:
            self._log_restart(pending, reinit_s=0.0)
        return self._reserve_phase(iteration)

    # ----- phases ----------------------------------------------------------------------------

    def _health_phase(self, iteration: int) -> None:
        """Before the first iteration and after every fault (``health.check_and_report``)."""
        assert self.health is not None and self.svc is not None
        check_and_report(
            self.health, self.store, self.svc.progress, me=self.me, iteration=iteration
        )

    def _reserve_phase(self, iteration: int) -> Outcome:
        """A reserve warms up and prewarms once, then waits until the iteration ends."""
        assert self.svc is not None
        prewarm, self.prewarmed = (None if self.prewarmed else self.cfg.prewarm), True
        return wait_as_reserve(self.svc, iteration, imports=self.first_use, prewarm=prewarm)

    def _active_phase(
        self,
        iteration: int,
        assignment: Assignment,
        rank: int,
        pending: _PendingRestart | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Outcome:
        """Run ``train()`` as ``rank`` (see ``inprocess.restart.active``); log the restart that led
        here once the group exists, so its ``reinit`` phase is measured."""
        assert self.svc is not None
        # A reserve taking a place: its first DDP(...) must not import what the background
        # imports are importing at the same time (see FirstUseImports.wait).
        self.first_use.wait()

        def on_started(reinit_s: float) -> RestartRecord | None:
            if pending is None:
                return None
            return self._restarted(pending, iteration, assignment, rank=rank, reinit_s=reinit_s)

        # The torchrun contract (RANK, LOCAL_RANK, ...) of this iteration, before train() runs.
        torchrun_env.export(
            torchrun_env.iteration_env(
                me=self.me,
                active=assignment.active,
                node_of=self.node_of,
                launch_local_rank=self.env.local_rank,
            )
        )

        if self.advice is not None and rank == 0:  # the job's first rank 0, once
            self.advice.start(reserves=len(assignment.reserve), max_respawns=self.env.max_respawns)
        try:
            return run_active(
                self.svc,
                self.fn,
                args,
                kwargs,
                iteration=iteration,
                assignment=assignment,
                rank=rank,
                on_started=on_started,
            )
        finally:
            self.story.end_iteration()
            if self.advice is not None and rank == 0:
                self.advice.stop()
                self.advice = None

    def _restarted(
        self,
        pending: _PendingRestart,
        iteration: int,
        assignment: Assignment,
        *,
        rank: int,
        reinit_s: float,
    ) -> RestartRecord:
        """Log the restart that led to ``iteration`` (its group exists) and start its console
        line: written by the new rank 0 (restart.story), naming the tier each active rank
        restored from (restart.restored)."""
        assert self.svc is not None
        record = self._log_restart(pending, reinit_s=reinit_s)
        board = TierBoard(
            self.svc.store,
            self.svc.new_client,
            iteration=iteration,
            me=self.me,
            active=assignment.active,
        )
        self.story.restarted(record, fault_time=pending.fault_time, lead=rank == 0, board=board)
        return record

    def _restart_phase(
        self, iteration: int, assignment: Assignment, target: int, out: Outcome
    ) -> _PendingRestart:
        """Meet at the restart barrier (``RestartAgreement.meet``: raises when the job stops);
        returns the restart decided, with the time each phase of the fault took."""
        assert self.svc is not None
        t_barrier = time.monotonic()
        decision = self.agreement.meet(
            self.store, self.svc.progress, iteration=iteration, assignment=assignment, target=target
        )
        return _PendingRestart.of(decision, before=assignment, out=out, t_barrier=t_barrier)

    def _log_restart(self, pending: _PendingRestart, *, reinit_s: float) -> RestartRecord:
        self.last_restart = pending.log(me=self.me, reinit_s=reinit_s)
        return self.last_restart
