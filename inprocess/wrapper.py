"""``@restartable``: the restart loop, run as a flat sequence of named phases per iteration.

Per rank: connect -> initial barrier -> assign ranks, then for each iteration:
join (active) or wait (reserve) -> train() -> completion, and on a fault:
unwind -> abort -> health check -> restart barrier (one decision wins) -> next iteration.
"""

from __future__ import annotations

import datetime
import functools
import json
import logging
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, TypeVar, overload

import torch
import torch.distributed as dist

from inprocess import store as keys
from inprocess.abort import GroupReaper, abort_process_groups
from inprocess.config import RestartConfig
from inprocess.context import RestartContext, RestartRecord, activated
from inprocess.environment import bind_to_launcher, read_env
from inprocess.errors import ConfigError, FaultRecord, RestartAbortedError, RestartInterrupt
from inprocess.health import HealthChecker
from inprocess.monitor import Interrupter, Monitor
from inprocess.progress import ProgressTracker
from inprocess.ranks import (
    Assignment,
    NotEnoughRanksError,
    initial_assignment,
    node_of_ranks,
    reassign,
)
from inprocess.store_server import client, connect, mark_left

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])
# Kinds that remove a rank for good (besides the process being gone).
_RETIRING_KINDS = frozenset({"unhealthy"})
# Kinds that count as "this rank faulted" for max_rank_faults and the repeated-fault stop.
_OWN_FAULT_KINDS = frozenset({"exception", "soft_timeout"})
# How collectives fail when a peer went away (gloo, NCCL, the store).
_PEER_LOST_MESSAGES = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "NCCL communicator was aborted",
    "DistNetworkError",
)


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


@dataclass
class _Outcome:
    """How one iteration ended for this rank."""

    done: bool
    value: Any = None
    noticed: float = 0.0  # time.time() this rank learnt of the fault
    abort_s: float = 0.0
    unwind_s: float = 0.0


class _Job:
    """One call of a ``@restartable`` function on one rank: owns every resource of the loop."""

    def __init__(self, cfg: RestartConfig, fn: Callable[..., Any]) -> None:
        self.cfg, self.fn = cfg, fn
        self.env = read_env()
        if self.env.launcher_pid is not None:
            bind_to_launcher(self.env.launcher_pid)
        cfg.validate_world(self.env.world_size)
        self.me = self.env.rank
        self.node_of = node_of_ranks(
            world_size=self.env.world_size, local_world_size=self.env.local_world_size
        )
        self.store: Any = None
        self.report_store: Any = None
        self.watchdog: Any = None  # inprocess.watchdog.Watchdog
        self.health: HealthChecker | None = None
        self.interrupter: Interrupter | None = None
        self.progress: ProgressTracker | None = None
        self.history: list[FaultRecord] = []
        self.signatures: list[tuple[Any, ...]] = []
        self.last_restart: RestartRecord | None = None
        self.prewarmed = False
        self.closed = False
        # Destroyed process groups, held until train()'s frames are gone (see GroupReaper).
        self.doomed: list[Any] = []
        self.reaper = GroupReaper(self._warn_lingering)
        self.warned_lingering = False

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
        abort_process_groups()
        self.reaper.close(timeout=self.cfg.hard_timeout)
        for owner in (self.interrupter, self.progress, self.watchdog, self.health):
            if owner is not None:
                try:
                    owner.close()
                except Exception as exc:
                    log.warning("closing %s failed: %r", type(owner).__name__, exc)
        if self.store is not None:
            try:
                mark_left(self.store)
            except Exception as exc:
                log.debug("could not mark this rank as left: %r", exc)

    # ----- the loop --------------------------------------------------------------------------

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        cfg = self.cfg
        self.store = connect(self.env, timeout=cfg.barrier_timeout)
        # Monitors record soft timeouts on their own client: the main thread's may be busy.
        self.report_store = client(
            self.env.master_addr, self.env.master_port, timeout=cfg.barrier_timeout
        )
        self.interrupter = Interrupter()
        self.progress = ProgressTracker()
        self.health = HealthChecker(
            user_checks=cfg.health_checks, empty_cuda_cache=cfg.empty_cuda_cache
        )
        # Imported here: `python -m inprocess.watchdog` imports this package first, and runpy
        # warns when the module it is about to run was already imported by the package.
        from inprocess.watchdog import Watchdog

        self.watchdog = Watchdog(
            store_host=self.env.master_addr,
            store_port=self.env.master_port,
            initial_rank=self.me,
            hard_timeout=cfg.hard_timeout,
            termination_grace_time=cfg.termination_grace_time,
            heartbeat_interval=cfg.heartbeat_interval,
            logdir=cfg.monitor_process_logdir,
        )
        self.watchdog.start()
        with self.progress.paused():
            keys.initial_barrier(
                self.store,
                world_size=self.env.world_size,
                timeout=cfg.barrier_timeout,
                clock=time.monotonic,
            )
        assignment = initial_assignment(
            world_size=self.env.world_size,
            node_of=self.node_of,
            active_world_size=cfg.active_world_size,
            granularity=cfg.granularity,
        )
        target = len(assignment.active)
        iteration = 0
        pending: dict[str, Any] | None = None  # the restart being completed, logged once
        while True:
            self.watchdog.set_iteration(iteration)
            keys.set_participants(
                self.store, iteration, len(assignment.active) + len(assignment.reserve)
            )
            if iteration == 0:
                self._health_phase(iteration)  # later: right after each fault, below
            rank = assignment.rank_of(self.me)
            if rank is not None:
                out = self._active_phase(iteration, assignment, rank, pending, args, kwargs)
            else:
                if pending is not None:
                    self._log_restart(pending, reinit_s=0.0)
                out = self._reserve_phase(iteration)
            pending = None
            if out.done:
                return out.value
            # Checked now, before the barrier, so an unhealthy rank is retired by this restart's
            # decision instead of costing another restart at the start of the next iteration.
            self._health_phase(iteration)
            t_barrier = time.monotonic()
            decision = self._restart_phase(iteration, assignment, target)
            barrier_s = time.monotonic() - t_barrier
            faults = [FaultRecord(**f) for f in decision["faults"]]
            if decision["stop"]:
                raise RestartAbortedError(decision["stop"], self.history)
            new = Assignment(
                active=tuple(decision["active"]),
                reserve=tuple(decision["reserve"]),
                retired=frozenset(decision["retired"]),
            )
            first = min((f.time for f in faults if f.time), default=out.noticed)
            pending = {
                "iteration": iteration + 1,
                "cause": "; ".join(f"{f.kind} on rank {f.initial_rank}" for f in faults[:4]),
                "faulting_ranks": sorted({f.initial_rank for f in faults}),
                "phases": {
                    "detect": max(0.0, out.noticed - first),
                    "abort": out.abort_s,
                    "unwind": out.unwind_s,
                    "barrier": barrier_s,
                },
                "before": assignment,
                "after": new,
            }
            if self.me in new.retired:
                self._log_restart(pending, reinit_s=0.0)
                log.warning(
                    "rank %d retired after iteration %d (%s); it leaves the job",
                    self.me,
                    iteration,
                    pending["cause"],
                )
                return None
            assignment = new
            iteration += 1

    # ----- phases ----------------------------------------------------------------------------

    def _health_phase(self, iteration: int) -> None:
        """Before the first iteration and after every fault (before the restart barrier): an
        unhealthy rank records a fault of ``iteration``, and the restart decision retires it."""
        assert self.health is not None and self.progress is not None
        with self.progress.paused():
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

    def _reserve_phase(self, iteration: int) -> _Outcome:
        """A reserve prewarms once, then waits until the iteration ends."""
        assert self.progress is not None
        if self.cfg.prewarm is not None and not self.prewarmed:
            self.prewarmed = True
            try:
                self.cfg.prewarm()
            except Exception as exc:
                log.exception("prewarm failed on reserve rank %d", self.me)
                keys.report_fault(
                    self.store,
                    iteration=iteration,
                    initial_rank=self.me,
                    kind="unhealthy",
                    detail=f"prewarm raised {exc!r}",
                )
        with self.progress.paused():
            result = keys.wait_outcome(self.store, iteration, timeout=None, clock=time.monotonic)
        if result == keys.OUTCOME_DONE:
            return _Outcome(done=True)
        return _Outcome(done=False, noticed=time.time())

    def _active_phase(
        self,
        iteration: int,
        assignment: Assignment,
        rank: int,
        pending: dict[str, Any] | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> _Outcome:
        """Join, create the process group, run ``train()`` under the monitor, then complete."""
        assert self.progress is not None and self.interrupter is not None
        cfg, store = self.cfg, self.store
        t_reinit = time.monotonic()
        with self.progress.paused():
            joined = keys.join_barrier(
                store,
                iteration,
                expected=len(assignment.active),
                timeout=cfg.barrier_timeout,
                clock=time.monotonic,
                recheck=functools.partial(self._break_if_gone, iteration, assignment.active),
            )
        if not joined:
            return _Outcome(done=False, noticed=time.time())
        monitor = Monitor(
            store=client(self.env.master_addr, self.env.master_port, timeout=cfg.barrier_timeout),
            report_store=self.report_store,
            iteration=iteration,
            initial_rank=self.me,
            soft_timeout=cfg.soft_timeout,
            progress=self.progress,
            interrupter=self.interrupter,
            abort=self._abort,
            step=lambda: ctx.step,
            check_interval=min(1.0, cfg.soft_timeout / 10),
            redeliver_interval=max(0.5, min(5.0, cfg.soft_timeout / 2)),
        )
        ctx = RestartContext(
            iteration=iteration,
            rank=rank,
            world_size=len(assignment.active),
            initial_rank=self.me,
            active_ranks=assignment.active,
            store=dist.PrefixStore(keys.pg_prefix(iteration) + "/user", store),
            last_restart=None,
            _progress=self.progress,
            _interrupter=self.interrupter,
        )
        value: Any = None
        exc: BaseException | None = None
        where = ""
        interrupted = delivered = False
        t_unwind = 0.0
        self.progress.stamp()
        self.interrupter.arm()
        monitor.start()
        try:
            try:
                self._init_process_group(iteration, rank, len(assignment.active))
                if cfg.init_process_group:
                    with self.progress.paused():
                        ready = keys.ready_barrier(
                            store,
                            iteration,
                            expected=len(assignment.active),
                            timeout=cfg.barrier_timeout,
                            clock=time.monotonic,
                        )
                    if not ready:
                        raise RestartInterrupt("a rank faulted while the group was created")
                if pending is not None:
                    ctx.last_restart = self._log_restart(
                        pending, reinit_s=time.monotonic() - t_reinit
                    )
                with activated(ctx):
                    value = self.fn(*args, **kwargs)
            except RestartInterrupt as ri:
                interrupted = True
                _drop_frames(ri)
                t_unwind = time.monotonic()
            except Exception as e:
                exc = e
                where = _raise_site(e)
                _drop_frames(e)
            finally:
                delivered = self._disarm()
        except RestartInterrupt:  # landed in the handlers above, before the disarm
            interrupted = True
            t_unwind = t_unwind or time.monotonic()
            delivered = self._disarm()
        except BaseException as e:  # SystemExit, KeyboardInterrupt: this rank leaves the job
            self._disarm()
            self._report(iteration, "dead", f"left the job: {e!r}", ctx.step)
            monitor.close()
            raise
        noticed = monitor.fired_at or time.time()
        if exc is not None:
            if keys.outcome(store, iteration) == keys.OUTCOME_FAULT:
                # A consequence of another rank's fault (its teardown broke our collective).
                log.info("rank %d: %r after another rank's fault; not counted", self.me, exc)
            else:
                self._report_exception(iteration, exc, ctx.step, where)
            noticed = time.time()
        t0 = time.monotonic()
        self._abort()
        abort_s = monitor.abort_s or time.monotonic() - t0
        groups, self.doomed = self.doomed, []
        self.reaper.release(groups)
        del groups
        unwind_s = time.monotonic() - t_unwind if interrupted else 0.0
        if exc is None and not interrupted and not delivered:
            keys.mark_completed(store, iteration, active=len(assignment.active))
            with self.progress.paused():
                result = keys.wait_outcome(
                    store, iteration, timeout=cfg.completion_timeout, clock=time.monotonic
                )
            if result is None:
                self._report(
                    iteration,
                    "completion_timeout",
                    f"other ranks did not finish within completion_timeout "
                    f"({cfg.completion_timeout} s)",
                    ctx.step,
                )
            elif result == keys.OUTCOME_DONE:
                monitor.close()
                return _Outcome(done=True, value=value)
            noticed = time.time()
        monitor.close()
        if cfg.empty_cuda_cache and torch.cuda.is_available():
            torch.cuda.empty_cache()
        return _Outcome(done=False, noticed=noticed, abort_s=abort_s, unwind_s=unwind_s)

    def _restart_phase(self, iteration: int, assignment: Assignment, target: int) -> Any:
        """Every live rank meets; one decides the next assignment (or the stop) for all."""
        assert self.progress is not None
        with self.progress.paused():
            raw = keys.restart_barrier(
                self.store,
                iteration,
                initial_rank=self.me,
                participants=assignment.active + assignment.reserve,
                decide=functools.partial(self._decide, iteration, assignment, target),
                timeout=self.cfg.barrier_timeout,
                clock=time.monotonic,
            )
        decision = json.loads(raw)
        faults = [FaultRecord(**f) for f in decision["faults"]]
        self.history.extend(faults)
        self.signatures.append(_signature(faults))
        return decision

    def _decide(
        self, iteration: int, assignment: Assignment, target: int, faults: list[FaultRecord]
    ) -> str:
        """The next assignment, or why the job stops; a pure function of shared state.

        Runs on the one rank that completes the restart barrier; every rank has the same
        ``history`` and ``signatures``, so the choice does not depend on which rank it is.
        """
        cfg = self.cfg
        history = [*self.history, *faults]
        participants = set(assignment.active) | set(assignment.reserve)
        lost = keys.gone_ranks(self.store) & participants
        lost |= {f.initial_rank for f in faults if f.kind in _RETIRING_KINDS}
        lost |= {f.initial_rank for f in faults if f.action == "retire"}
        if cfg.max_rank_faults is not None:
            per_rank: dict[int, set[int]] = {}
            for f in history:
                same_iteration = [g for g in history if g.iteration == f.iteration]
                if f.kind in _OWN_FAULT_KINDS and not _is_collateral(f, same_iteration):
                    per_rank.setdefault(f.initial_rank, set()).add(f.iteration)
            lost |= {r for r, its in per_rank.items() if len(its) > cfg.max_rank_faults}
        lost &= participants
        demoted = {f.initial_rank for f in faults if f.action == "demote"} - lost
        stop = None
        sigs = [*self.signatures, _signature(faults)]
        n = cfg.max_same_fault
        if len(sigs) >= n and sigs[-1] and all(s == sigs[-1] for s in sigs[-n:]):
            stop = (
                f"the same fault repeated {n} times in a row (max_same_fault={n}): "
                f"{faults[0].summary() if faults else ''}; fix the fault (or raise max_same_fault)"
            )
        elif cfg.max_iterations is not None and iteration + 1 >= cfg.max_iterations:
            stop = (
                f"max_iterations ({cfg.max_iterations}) reached: train() ran "
                f"{iteration + 1} times and the last run faulted; raise max_iterations or fix "
                "the fault"
            )
        new: Assignment | None = None
        if stop is None:
            try:
                new = reassign(
                    assignment,
                    node_of=self.node_of,
                    lost=sorted(lost),
                    demoted=sorted(demoted),
                    granularity=cfg.granularity,
                    active_world_size=target,
                    min_active_world_size=min(cfg.min_active_world_size, target),
                )
            except NotEnoughRanksError as exc:
                stop = f"not enough healthy ranks to continue: {exc}"
        return json.dumps(
            {
                "faults": [asdict(f) for f in faults],
                "stop": stop,
                "active": list(new.active) if new else [],
                "reserve": list(new.reserve) if new else [],
                "retired": sorted(new.retired) if new else [],
            }
        )

    # ----- helpers ---------------------------------------------------------------------------

    def _init_process_group(self, iteration: int, rank: int, world_size: int) -> None:
        cfg = self.cfg
        if not cfg.init_process_group:
            return
        backend = cfg.backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl" and torch.cuda.is_available():
            torch.cuda.set_device(self.env.local_rank % torch.cuda.device_count())
        # gloo collectives cannot be aborted: one blocked on a peer ends when that peer's group
        # is freed, or at this timeout, which is what frees ranks stuck behind a group that
        # something still holds (keep it short). Order: soft_timeout < this < hard_timeout.
        # Just above soft_timeout, so a hung rank's own monitor (soft_timeout + one check
        # interval) reports first and is blamed, not the rank waiting for it; below
        # hard_timeout, because some waits hold the GIL (seen: a peer's heartbeat stopped) and
        # the watchdog would kill a healthy rank.
        timeout = (
            min(1.25 * cfg.soft_timeout, (cfg.soft_timeout + cfg.hard_timeout) / 2)
            if backend == "gloo"
            else cfg.barrier_timeout
        )
        # init_process_group wraps sys.excepthook with a "[rankN]:" prefix each time it is
        # called: once per iteration would stack the prefixes. Keep the process's own hook.
        excepthook = sys.excepthook
        try:
            dist.init_process_group(
                backend=backend,
                store=dist.PrefixStore(keys.pg_prefix(iteration), self.store),
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=timeout),
            )
        finally:
            sys.excepthook = excepthook

    def _abort(self) -> None:
        """Tear down this rank's groups (monitor or main thread); hold them for the reaper."""
        self.doomed.extend(abort_process_groups())

    def _warn_lingering(self, alive: int) -> None:
        """Reaper thread: destroyed groups are still referenced after train() unwound."""
        if self.warned_lingering:
            return
        self.warned_lingering = True
        log.warning(
            "rank %d: %d destroyed process group(s) still referenced after train() unwound "
            "(e.g. a DDP-wrapped model kept by an object that outlives train()); peers "
            "blocked on this rank are released only by the group timeout (about "
            "1.25 x soft_timeout for gloo). Create such objects inside train() "
            "to restart in milliseconds.",
            self.me,
            alive,
        )

    def _disarm(self) -> bool:
        """Stop the monitor's deliveries; a delivery racing with this call is absorbed."""
        assert self.interrupter is not None
        while True:
            try:
                return self.interrupter.disarm()
            except RestartInterrupt:
                continue

    def _break_if_gone(self, iteration: int, active: tuple[int, ...]) -> bool:
        """Join recheck: an active rank that died during the restart breaks the barrier."""
        dead = keys.gone_ranks(self.store) & set(active)
        for r in sorted(dead):
            keys.report_fault(
                self.store,
                iteration=iteration,
                initial_rank=r,
                kind="dead",
                detail="lost during the restart",
            )
        return bool(dead)

    def _report(self, iteration: int, kind: str, detail: str, step: int | None) -> None:
        keys.record_fault(
            self.store,
            FaultRecord(
                iteration=iteration,
                initial_rank=self.me,
                kind=kind,
                detail=detail,
                step=step,
                time=time.time(),
            ),
        )

    def _report_exception(
        self, iteration: int, exc: BaseException, step: int | None, where: str
    ) -> None:
        action = getattr(exc, "restartable_rank_action", "")
        log.error("rank %d: train() raised in iteration %d", self.me, iteration, exc_info=exc)
        keys.record_fault(
            self.store,
            FaultRecord(
                iteration=iteration,
                initial_rank=self.me,
                kind="exception",
                detail=f"{type(exc).__name__}: {exc}"[:500],
                exc_type=f"{type(exc).__module__}.{type(exc).__qualname__}",
                where=where,
                step=step,
                action=action if action in ("demote", "retire") else "",
                time=time.time(),
            ),
        )

    def _log_restart(self, pending: dict[str, Any], *, reinit_s: float) -> RestartRecord:
        before: Assignment = pending["before"]
        after: Assignment = pending["after"]
        record = RestartRecord(
            iteration=pending["iteration"],
            cause=pending["cause"],
            faulting_ranks=tuple(pending["faulting_ranks"]),
            phases={**pending["phases"], "reinit": reinit_s},
            active_before=before.active,
            active_after=after.active,
            reserve_after=after.reserve,
        )
        self.last_restart = record
        log.info(
            "restart %s",
            json.dumps({**asdict(record), "rank": self.me}, sort_keys=True),
            extra={"restart": asdict(record), "rank": self.me, "iteration": record.iteration},
        )
        return record


def _raise_site(exc: BaseException) -> str:
    """``file:line`` of the innermost frame of ``exc``'s traceback (the raise)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}" if tb is not None else ""


def _drop_frames(exc: BaseException) -> None:
    """Release the locals of ``train()``'s frames held by ``exc``'s traceback.

    A collective that raised leaves its frame (holding the process group) in the traceback; as
    long as it lives, destroying the group does not close its sockets, and peers blocked on
    this rank are not released. Logged tracebacks are formatted before this.
    """
    log.debug("train() unwound", exc_info=exc) if log.isEnabledFor(logging.DEBUG) else None
    traceback.clear_frames(exc.__traceback__)
    exc.__traceback__ = None


def _is_collateral(f: FaultRecord, faults: list[FaultRecord]) -> bool:
    """An exception that is a consequence of another rank's fault in the same iteration.

    A peer that dies or tears down its group makes collectives on other ranks fail with a
    connection error, sometimes before the peer's own fault is recorded. Such a rank did nothing
    wrong: it must not count towards ``max_rank_faults`` or the repeated-fault stop.
    """
    if f.kind != "exception" or not any(m in f.detail for m in _PEER_LOST_MESSAGES):
        return False
    return any(g.initial_rank != f.initial_rank and g.kind != "exception" for g in faults) or any(
        g.initial_rank != f.initial_rank
        and g.kind == "exception"
        and not any(m in g.detail for m in _PEER_LOST_MESSAGES)
        for g in faults
    )


def _signature(faults: list[FaultRecord]) -> tuple[Any, ...]:
    """What must repeat for the repeated-fault stop: who faulted how, where and at which step."""
    return tuple(
        sorted(
            {
                (f.initial_rank, f.kind, f.exc_type, f.where, -1 if f.step is None else f.step)
                for f in faults
                if f.kind in _OWN_FAULT_KINDS and not _is_collateral(f, faults)
            }
        )
    )
