"""``@restartable``: the restart loop, run as a flat sequence of named phases per iteration.

Per rank: connect -> initial barrier -> assign ranks, then for each iteration:
join (active) or wait (reserve) -> train() -> completion, and on a fault:
unwind -> abort -> health check -> restart barrier (one decision wins) -> next iteration.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable
from dataclasses import asdict
from typing import Any, TypeVar, overload

from restartable.checkpoint.sealing import ForgedValueError
from restartable.inprocess import journal
from restartable.inprocess.clock import SYSTEM, Clock
from restartable.inprocess.config import RestartConfig
from restartable.inprocess.context import RestartRecord
from restartable.inprocess.errors import ConfigError, RestartAbortedError, StoreTimeoutError
from restartable.inprocess.protocol import job_keys, restart_meeting
from restartable.inprocess.protocol.environment import bind_to_launcher, read_env
from restartable.inprocess.protocol.ranks import Assignment, initial_assignment, node_of_ranks
from restartable.inprocess.restart import joining, torchrun_env
from restartable.inprocess.restart.active import Outcome, run_active
from restartable.inprocess.restart.advice import KillAdvice
from restartable.inprocess.restart.agreement import RestartAgreement
from restartable.inprocess.restart.health import check_and_report
from restartable.inprocess.restart.lifetime import RankLifetime
from restartable.inprocess.restart.pending import PendingRestart
from restartable.inprocess.restart.process_group import check_no_default_group
from restartable.inprocess.restart.reserve import wait_as_reserve

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


class _Job:
    """One call of a ``@restartable`` function on one rank: the restart loop.

    ``run()`` is the loop; each iteration is a sequence of named phases (``_active_phase`` or
    ``_reserve_phase``, then on a fault ``_health_phase`` and ``_restart_phase``). Every resource
    is ``own``'s (``inprocess.restart.lifetime``): it brings the rank up before the first
    iteration, and ``close()`` releases everything, whatever state the loop stopped in. A
    reserve's iteration is ``inprocess.restart.reserve``'s, the restart barrier and its decision
    ``inprocess.restart.agreement``'s, the restart's record ``inprocess.restart.pending``'s.
    """

    def __init__(
        self, cfg: RestartConfig, fn: Callable[..., Any], *, clock: Clock = SYSTEM
    ) -> None:
        self.cfg, self.fn = cfg, fn
        self.clock = clock  # every wait and timing of this rank's loop and what it creates
        self.env = read_env()
        if self.env.launcher_pid is not None:
            bind_to_launcher(self.env.launcher_pid)
        cfg.validate_world(self.env.world_size)
        if cfg.init_process_group:
            check_no_default_group()
        # A process the launcher respawned joins under a new identity (inprocess.protocol.ranks).
        self.me = self.env.identity
        self.joining = self.env.respawn_generation > 0
        self.registered_at = 0  # a respawned process: the iteration announced when it registered
        self.node_of = node_of_ranks(
            world_size=self.env.world_size, local_world_size=self.env.local_world_size
        )
        # Every fault of every restart (for the stop error) and what each restart blamed.
        self.agreement = RestartAgreement(cfg, me=self.me, node_of=self.node_of, clock=clock)
        self.prewarmed = False
        self.advice: KillAdvice | None = KillAdvice()  # None once started (restart.advice)
        self.outcome = "failed"  # "done" / "stopped" once run() knows (the journal's job_end)
        # Everything this rank starts and releases (restart.lifetime): the store's URL first.
        self.own = RankLifetime(cfg, self.env, me=self.me, clock=clock)

    # ----- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> _Job:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release everything this rank started (``RankLifetime.close``; idempotent)."""
        self.own.close(self.outcome)

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
            if self.own.is_open:
                job_keys.mark_stopped(
                    self.own.store,
                    str(getattr(exc, "reason", exc)),
                    origin=getattr(exc, "origin", ""),
                )
            raise

    def _run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.registered_at = self.own.open(joining_job=self.joining)
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
                self.own.store,
                self.own.watchdog,
                self.agreement,
                self.cfg,
                me=self.me,
                slot=self.env.rank,
                since=self.registered_at,
            )
            if admitted is None:
                return None  # the job finished before a restart needed this process
            iteration, assignment = admitted.iteration, admitted.assignment
        pending: PendingRestart | None = None  # the restart being completed, logged once
        while True:
            out = self._iteration(iteration, assignment, pending, args, kwargs)
            if out.done:
                return out.value
            # Checked now, before the barrier, so an unhealthy rank is retired by this restart's
            # decision instead of costing another restart at the start of the next iteration.
            self._health_phase(iteration)
            pending = self._restart_phase(iteration, assignment, target, out)
            if self.me in pending.after.retired:
                _log_restart(pending, me=self.me, reinit_s=0.0)
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
        pending: PendingRestart | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Outcome:
        """Announce ``iteration``, then run it in this rank's role (active or reserve)."""
        self.own.announce(iteration, assignment)
        if iteration == 0:
            self._health_phase(iteration)  # later: right after each fault, in _run
        rank = assignment.rank_of(self.me)
        if self.own.journal is not None:
            self.own.journal.set_position(iteration=iteration, training_rank=rank)
            journal.record("iteration_start", active=rank is not None)
        if rank is not None:
            return self._active_phase(iteration, assignment, rank, pending, args, kwargs)
        if pending is not None:
            _log_restart(pending, me=self.me, reinit_s=0.0)
        return self._reserve_phase(iteration)

    # ----- phases ----------------------------------------------------------------------------

    def _health_phase(self, iteration: int) -> None:
        """Before the first iteration and after every fault (``health.check_and_report``)."""
        own = self.own
        assert own.health is not None and own.svc is not None
        check_and_report(own.health, own.store, own.svc.progress, me=self.me, iteration=iteration)

    def _reserve_phase(self, iteration: int) -> Outcome:
        """A reserve warms up and prewarms once, then waits until the iteration ends."""
        assert self.own.svc is not None
        prewarm, self.prewarmed = (None if self.prewarmed else self.cfg.prewarm), True
        return wait_as_reserve(self.own.svc, iteration, imports=self.own.first_use, prewarm=prewarm)

    def _active_phase(
        self,
        iteration: int,
        assignment: Assignment,
        rank: int,
        pending: PendingRestart | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Outcome:
        """Run ``train()`` as ``rank`` (see ``inprocess.restart.active``); log the restart that led
        here once the group exists, so its ``reinit`` phase is measured."""
        assert self.own.svc is not None
        # A reserve taking a place: its first DDP(...) must not import what the background
        # imports are importing at the same time (see FirstUseImports.wait).
        self.own.first_use.wait()

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
                self.own.svc,
                self.fn,
                args,
                kwargs,
                iteration=iteration,
                assignment=assignment,
                rank=rank,
                on_started=on_started,
            )
        finally:
            self.own.story.end_iteration()
            if self.advice is not None and rank == 0:
                self.advice.stop()
                self.advice = None

    def _restarted(
        self,
        pending: PendingRestart,
        iteration: int,
        assignment: Assignment,
        *,
        rank: int,
        reinit_s: float,
    ) -> RestartRecord:
        """Log the restart that led to ``iteration`` (its group exists) and start its console
        line: written by the new rank 0 (restart.story), naming the tier each active rank
        restored from (restart.restored)."""
        record = _log_restart(pending, me=self.me, reinit_s=reinit_s)
        board = self.own.tier_board(iteration, assignment.active)
        self.own.story.restarted(record, fault_time=pending.fault_time, lead=rank == 0, board=board)
        return record

    def _restart_phase(
        self, iteration: int, assignment: Assignment, target: int, out: Outcome
    ) -> PendingRestart:
        """Meet at the restart barrier (``restart_meeting.restart_barrier``; the one rank that
        decides runs ``RestartAgreement.decider``), then act on the published decision
        (``RestartAgreement.accept``: raises when the job stops); returns the restart decided,
        with the time each phase of the fault took."""
        own = self.own
        assert own.svc is not None
        t_barrier = self.clock.monotonic()
        with own.svc.progress.paused():
            published = (self.own.node or restart_meeting).restart_barrier(
                own.store,
                iteration,
                initial_rank=self.me,
                participants=assignment.active + assignment.reserve,
                decide=self.agreement.decider(own.store, iteration, assignment, target),
                timeout=self.cfg.barrier_timeout,
                clock=self.clock,
            )
        decision = self.agreement.accept(published)
        barrier_s = self.clock.monotonic() - t_barrier
        return PendingRestart.of(decision, before=assignment, out=out, barrier_s=barrier_s)


def _log_restart(pending: PendingRestart, *, me: int, reinit_s: float) -> RestartRecord:
    """Journal and log ``pending`` once (``inprocess.restart.loop: restart {...}``); returns its
    record. DEBUG: every rank writes it, and the console's INFO line of a restart is the new
    rank 0's (``inprocess.restart.story``); the journal has the same record."""
    record = pending.record(reinit_s=reinit_s)
    journal.record("restart", **asdict(record))
    log.debug(
        "restart %s",
        json.dumps({**asdict(record), "rank": me}, sort_keys=True),
        extra={"restart": asdict(record), "rank": me, "iteration": record.iteration},
    )
    for c in pending.decision.collateral:
        log.debug("not counted: rank %d %s: %s", c.fault.initial_rank, c.fault.kind, c.reason)
    return record
