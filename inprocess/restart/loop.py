"""``@restartable``: the restart loop, run as a flat sequence of named phases per iteration.

Per rank: connect -> initial barrier -> assign ranks, then for each iteration:
join (active) or wait (reserve) -> train() -> completion, and on a fault:
unwind -> abort -> health check -> restart barrier (one decision wins) -> next iteration.
"""

from __future__ import annotations

import functools
import gc
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, TypeVar, overload

from checkpoint.sealing import job_sealer
from inprocess import journal
from inprocess.config import RestartConfig
from inprocess.context import RestartRecord
from inprocess.errors import (
    ConfigError,
    FaultRecord,
    RestartAbortedError,
    RestartInterrupt,
    StoreTimeoutError,
)
from inprocess.etcd.connect import open_store
from inprocess.etcd.url import parse_url
from inprocess.faults import drill
from inprocess.protocol import capacity, job_keys, keys
from inprocess.protocol.environment import bind_to_launcher, read_env, store_setting
from inprocess.protocol.policy import Decision, Observed, decide
from inprocess.protocol.ranks import Assignment, initial_assignment, node_of_ranks
from inprocess.protocol.sealed_store import seal
from inprocess.restart import torchrun_env
from inprocess.restart.abort import GroupReaper, abort_process_groups
from inprocess.restart.active import ClientPool, Outcome, RankServices, disarm, run_active
from inprocess.restart.health import HealthChecker
from inprocess.restart.monitor import Interrupter
from inprocess.restart.process_group import check_no_default_group
from inprocess.restart.progress import ProgressTracker
from inprocess.restart.rendezvous import Rendezvous, advertised_host
from inprocess.restart.story import RestartStory
from inprocess.store_server import client, connect, mark_left
from inprocess.timeouts.sections import section_clock

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


class _Job:
    """One call of a ``@restartable`` function on one rank: owns every resource of the loop.

    ``run()`` is the loop; each iteration is a sequence of named phases (``_active_phase`` or
    ``_reserve_phase``, then on a fault ``_health_phase`` and ``_restart_phase``). ``close()``
    releases everything, whatever state the loop stopped in.
    """

    def __init__(self, cfg: RestartConfig, fn: Callable[..., Any]) -> None:
        self.cfg, self.fn = cfg, fn
        self.env = read_env()
        if self.env.launcher_pid is not None:
            bind_to_launcher(self.env.launcher_pid)
        cfg.validate_world(self.env.world_size)
        if cfg.init_process_group:
            check_no_default_group()
        # The etcd store (docs/etcd.md) when the config or INPROCESS_STORE names one.
        self.store_url = store_setting(cfg.store, self.env)
        if self.store_url is not None and cfg.store is None:
            cfg.check_store_timeouts(self.store_url, source="INPROCESS_STORE")
        if cfg.store is not None and self.env.launcher_pid is not None and not self.env.store_url:
            log.warning(
                "store=%r is set but inprocess.launch was started without --store: the "
                "launcher cannot see this job's keys (respawn and in-job restart will not work); "
                "give the launcher --store %s",
                cfg.store,
                cfg.store,
            )
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
        self.history: list[FaultRecord] = []  # every fault of every restart, for the stop error
        self.counted: list[tuple[FaultRecord, ...]] = []  # what each restart blamed (the policy)
        self.last_restart: RestartRecord | None = None
        self.prewarmed = False
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
        for owner in (*owners, self.watchdog, self.health):
            if owner is not None:
                try:
                    owner.close()
                except Exception as exc:
                    log.warning("closing %s failed: %r", type(owner).__name__, exc)
        if self.store is not None:
            try:
                left = mark_left(self.store, self.me)
                if self._owns_cleanup() and (
                    left + len(keys.gone_ranks(self.store)) >= self.env.world_size
                ):
                    # The last rank out of a job without a launcher (the others left or
                    # died): nobody reads the job's keys any more. A TCPStore's keys go with
                    # its server; inprocess.launch deletes the keys when the whole job is over.
                    self.store.delete_all()
                    log.info("rank %d: last to leave; deleted the job's keys", self.me)
            except Exception as exc:
                log.debug("could not mark this rank as left: %r", exc)
            if self.store_url is not None:  # EtcdStore clients hold HTTP connections
                for store in (self.store, svc.report_store if svc is not None else None):
                    if store is not None:
                        store.close()
        if self.journal is not None:  # last: the job's end includes this clean-up
            journal.record("job_end", outcome=self.outcome)
            self.journal.close()

    def _owns_cleanup(self) -> bool:
        """Whether the last rank to leave deletes the job's keys: only on etcd and without
        ``inprocess.launch`` (whose processes still read the keys; it deletes them itself)."""
        return self.store_url is not None and self.env.launcher_pid is None

    def _start(self) -> RankServices:
        """Connect, start the watchdog and meet every rank once (the initial barrier)."""
        cfg, env = self.cfg, self.env
        new_raw: Callable[[], Any]
        advertise = ""
        # Every value this process writes to the store is sealed with the job's secret (from
        # inprocess.launch, or made by the first process of the job: docs/security.md).
        sealer = job_sealer()
        if self.store_url is not None:
            new_raw = functools.partial(
                open_store, self.store_url, job_id=env.job_id, timeout=cfg.barrier_timeout
            )
            self.store = seal(new_raw(), sealer)
            advertise = advertised_host(parse_url(self.store_url).endpoints)
        else:
            new_raw = functools.partial(
                client, env.master_addr, env.master_port, timeout=cfg.barrier_timeout
            )
            self.store = seal(connect(env, timeout=cfg.barrier_timeout), sealer)

        def new_client() -> Any:
            return seal(new_raw(), sealer)

        svc = self.svc = RankServices(
            config=cfg,
            me=self.me,
            local_rank=env.local_rank,
            store=self.store,
            # Monitors record soft timeouts on their own client: the main thread's may be busy.
            report_store=new_client(),
            new_client=new_client,
            progress=ProgressTracker(),
            interrupter=Interrupter(),
            abort=self.reaper.abort,
            release=self.reaper.release,
            sections=section_clock(cfg),  # learned timeouts outlive iterations
            clients=ClientPool(new_client),
            rendezvous=Rendezvous(
                self.store,
                me=self.me,
                hosted=self.store_url is not None,
                advertise=advertise,
                timeout=cfg.barrier_timeout,
            ),
        )
        self.health = HealthChecker(
            user_checks=cfg.health_checks, empty_cuda_cache=cfg.empty_cuda_cache
        )
        # Imported here: `python -m inprocess.watchdog` imports this package first, and runpy
        # warns when the module it is about to run was already imported by the package.
        from inprocess.watchdog.owner import Watchdog

        self.watchdog = Watchdog(
            store_host=env.master_addr,
            store_port=env.master_port,
            store_url=self.store_url,
            job_id=env.job_id,
            initial_rank=self.me,
            hard_timeout=cfg.hard_timeout,
            termination_grace_time=cfg.termination_grace_time,
            heartbeat_interval=cfg.effective_heartbeat_interval,
            logdir=cfg.monitor_process_logdir,
            secret=sealer.secret if sealer is not None else None,
        )
        if self.joining:
            # Watched from now on, so that it is a ready reserve the moment it registers; until
            # it is admitted its death is reported for an iteration nobody waits on, which only
            # marks it gone (it must not interrupt the ranks that train).
            self.watchdog.set_iteration(job_keys.PARKED_ITERATION)
            self.watchdog.start()
            # Read before registering: the decision that admits this process can only come
            # after it registered, so it is one of this iteration's or a later one's. Read
            # after, it could already be past (the decision taken and the next iteration
            # announced meanwhile), and the wait below would never see its admission.
            self.registered_at = job_keys.current_iteration(self.store)
            job_keys.register_joiner(self.store, self.me)
            return svc
        self.watchdog.start()
        with svc.progress.paused():
            keys.initial_barrier(
                self.store,
                world_size=env.world_size,
                timeout=cfg.barrier_timeout,
                clock=time.monotonic,
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
        except (RestartAbortedError, StoreTimeoutError) as exc:
            self.outcome = "stopped"
            if self.store is not None:
                job_keys.mark_stopped(
                    self.store, str(getattr(exc, "reason", exc)), origin=getattr(exc, "origin", "")
                )
            raise

    def _freeze_gc(self) -> None:
        """``freeze_gc``: collect, then freeze every object that exists now out of later
        collections. Before connecting: for a respawned process, before it is a ready reserve,
        so the 0.1-0.3 s this takes is never on a restart's path."""
        if not self.cfg.freeze_gc or not gc.isenabled():
            return
        # A full collection walks every object, torch's modules included (0.1-0.14 s here,
        # measured with gc.callbacks). One that fell between a fault and the next train() made
        # each restart wait for it: benchmarks/store_etcd.py's TCPStore restart took 0.20-0.31
        # s instead of 0.03 s in 12 of 12 runs of one build, 0.03 s in 4 of 4 with this.
        # Collected first, so no garbage of the start-up is kept forever.
        t0 = time.monotonic()
        gc.collect()
        gc.freeze()
        log.debug(
            "rank %d: froze %d objects in %.3f s",
            self.me,
            gc.get_freeze_count(),
            time.monotonic() - t0,
        )

    def _run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self._freeze_gc()
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
            admitted = self._admit()
            if admitted is None:
                return None  # the job finished before a restart needed this process
            iteration, assignment = admitted.iteration, admitted.assignment
        pending: _PendingRestart | None = None  # the restart being completed, logged once
        while True:
            # A reserve's death only marks it gone: it never interrupts the training (issue 35).
            self.watchdog.set_iteration(iteration, reserve=assignment.rank_of(self.me) is None)
            job_keys.start_iteration(
                self.store,
                iteration,
                participants=len(assignment.active) + len(assignment.reserve),
                reserves=assignment.reserve,
            )
            if iteration == 0:
                self._health_phase(iteration)  # later: right after each fault, below
            rank = assignment.rank_of(self.me)
            if self.journal is not None:
                self.journal.set_position(iteration=iteration, training_rank=rank)
                journal.record("iteration_start", active=rank is not None)
            if rank is not None:
                out = self._active_phase(iteration, assignment, rank, pending, args, kwargs)
            else:
                if pending is not None:
                    self._log_restart(pending, reinit_s=0.0)
                out = self._reserve_phase(iteration)
            if out.done:
                return out.value
            # Checked now, before the barrier, so an unhealthy rank is retired by this restart's
            # decision instead of costing another restart at the start of the next iteration.
            self._health_phase(iteration)
            t_barrier = time.monotonic()
            decision = self._restart_phase(iteration, assignment, target)
            if decision.stop is not None or decision.assignment is None:
                raise RestartAbortedError(
                    decision.stop or "no assignment", self.history, origin=decision.stop_origin
                )
            first = min((f.time for f in decision.faults if f.time), default=out.noticed)
            pending = _PendingRestart(
                decision=decision,
                before=assignment,
                after=decision.assignment,
                phases={
                    "detect": max(0.0, out.noticed - first),
                    "abort": out.abort_s,
                    "unwind": out.unwind_s,
                    "barrier": time.monotonic() - t_barrier,
                },
                fault_time=first,
            )
            if self.me in decision.assignment.retired:
                self._log_restart(pending, reinit_s=0.0)
                log.warning(
                    "rank %d retired after iteration %d (%s); it leaves the job",
                    self.me,
                    iteration,
                    decision.cause(),
                )
                return None
            assignment = decision.assignment
            iteration += 1

    def _admit(self) -> job_keys.Admission | None:
        """A respawned process waits for a restart decision that admits it to the reserve pool,
        and takes over the decisions' history (every rank decides from the same one)."""
        assert self.svc is not None
        admitted = job_keys.wait_admission(
            self.store,
            identity=self.me,
            decision_timeout=self.cfg.barrier_timeout,
            since=self.registered_at,
        )
        if admitted is None:
            log.info("respawned rank %d: the job finished before it was needed", self.me)
            return None
        for d in admitted.decisions:
            self.history.extend(d.faults)
            self.counted.append(d.counted)
        self.watchdog.set_iteration(admitted.iteration)
        role = "active" if admitted.assignment.rank_of(self.me) is not None else "reserve"
        log.info(
            "respawned rank %d (slot %d) admitted as %s from iteration %d",
            self.me,
            self.env.rank,
            role,
            admitted.iteration,
        )
        return admitted

    # ----- phases ----------------------------------------------------------------------------

    def _health_phase(self, iteration: int) -> None:
        """Before the first iteration and after every fault (before the restart barrier): an
        unhealthy rank records a fault of ``iteration``, and the restart decision retires it."""
        assert self.health is not None and self.svc is not None
        with self.svc.progress.paused():
            try:
                reason = self.health.check()
            except Exception as exc:  # a broken check is an unhealthy rank, not a dead job
                reason = f"health check raised {exc!r}"
        if reason is not None:
            log.warning("rank %d unhealthy before iteration %d: %s", self.me, iteration, reason)
            keys.report_fault(
                self.store,
                iteration=iteration,
                initial_rank=self.me,
                kind="unhealthy",
                detail=reason,
            )

    def _reserve_phase(self, iteration: int) -> Outcome:
        """A reserve prewarms once, then waits until the iteration ends."""
        assert self.svc is not None
        if self.cfg.prewarm is not None and not self.prewarmed:
            self.prewarmed = True
            self._prewarm(iteration, self.cfg.prewarm)
        with self.svc.progress.paused():
            result = keys.wait_outcome(self.store, iteration, timeout=None, clock=time.monotonic)
        if result == keys.OUTCOME_DONE:
            return Outcome(done=True)
        return Outcome(done=False, noticed=time.time())

    def _prewarm(self, iteration: int, prewarm: Callable[[], Any]) -> None:
        """Run the user's ``prewarm`` on this reserve, interrupted if the iteration ends first.

        Found by the fault matrix: a prewarm that hung kept the reserve, and so the whole job,
        from ever exiting after training finished. The end of the iteration (the job done, or a
        restart that may need this reserve) is delivered like a restart; a prewarm that raises
        makes this reserve unhealthy (retired at the next decision).
        """
        svc = self.svc
        assert svc is not None
        ended = threading.Event()

        def watch() -> None:
            try:
                keys.wait_outcome(svc.new_client(), iteration, timeout=None, clock=time.monotonic)
            except Exception as exc:
                log.debug("prewarm watcher: store unreachable: %r", exc)
                return
            if not ended.is_set():
                svc.interrupter.deliver()

        svc.interrupter.arm()
        threading.Thread(target=watch, name="inprocess-prewarm-watch", daemon=True).start()
        try:
            try:
                prewarm()
            except Exception as exc:
                log.exception("prewarm failed on reserve rank %d", self.me)
                keys.report_fault(
                    self.store,
                    iteration=iteration,
                    initial_rank=self.me,
                    kind="unhealthy",
                    detail=f"prewarm raised {exc!r}",
                )
            finally:
                ended.set()
                disarm(svc.interrupter)
        except RestartInterrupt:
            disarm(svc.interrupter)
            log.warning(
                "reserve rank %d: iteration %d ended during prewarm: prewarm abandoned",
                self.me,
                iteration,
            )

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
        here
        once the group exists, so its ``reinit`` phase is measured."""
        assert self.svc is not None

        def on_started(reinit_s: float) -> RestartRecord | None:
            if pending is None:
                return None
            record = self._log_restart(pending, reinit_s=reinit_s)
            if rank == 0:  # one console line per restart, by the new rank 0 (restart.story)
                self.story.restarted(record, fault_time=pending.fault_time)
            return record

        # The torchrun contract (RANK, LOCAL_RANK, ...) of this iteration, before train() runs.
        torchrun_env.export(
            torchrun_env.iteration_env(
                me=self.me,
                active=assignment.active,
                node_of=self.node_of,
                launch_local_rank=self.env.local_rank,
            )
        )

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

    def _restart_phase(self, iteration: int, assignment: Assignment, target: int) -> Decision:
        """Every live rank meets; the first decision published is the one all ranks act on."""
        assert self.svc is not None
        with self.svc.progress.paused():
            raw = keys.restart_barrier(
                self.store,
                iteration,
                initial_rank=self.me,
                participants=assignment.active + assignment.reserve,
                decide=functools.partial(self._decide, iteration, assignment, target),
                timeout=self.cfg.barrier_timeout,
                clock=time.monotonic,
            )
        decision = Decision.from_json(raw)
        self.history.extend(decision.faults)
        self.counted.append(decision.counted)
        return decision

    def _decide(
        self, iteration: int, assignment: Assignment, target: int, faults: list[FaultRecord]
    ) -> str:
        """Gather the policy's inputs from the store and decide
        (``inprocess.protocol.policy.decide``).

        Any rank that finds the restart barrier full may run this; the store keeps the first
        decision published, so every rank acts on the same one. Every rank holds the same
        ``counted`` history (each appends the published decisions), so the inputs differ
        between ranks only in what the store held at the moment each read it.
        """

        def decide_with(gone: frozenset[int], joined: frozenset[int]) -> Decision:
            observed = Observed(iteration, tuple(faults), gone=gone, joined=joined)
            return decide(
                observed,
                history=self.counted,
                assignment=assignment,
                target=target,
                node_of=self.node_of,
                config=self.cfg,
            )

        # Short of ranks, wait for the respawns the launchers announced (issue 35).
        return capacity.decide_waiting(
            self.store,
            decide_with,
            iteration=iteration,
            target=target,
            timeout=self.cfg.effective_respawn_wait_timeout,
        ).to_json()

    # ----- helpers ---------------------------------------------------------------------------

    def _log_restart(self, pending: _PendingRestart, *, reinit_s: float) -> RestartRecord:
        record = pending.record(reinit_s=reinit_s)
        self.last_restart = record
        journal.record("restart", **asdict(record))
        log.info(
            "restart %s",
            json.dumps({**asdict(record), "rank": self.me}, sort_keys=True),
            extra={"restart": asdict(record), "rank": self.me, "iteration": record.iteration},
        )
        for c in pending.decision.collateral:
            log.debug("not counted: rank %d %s: %s", c.fault.initial_rank, c.fault.kind, c.reason)
        return record
