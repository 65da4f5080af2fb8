"""One iteration of an active rank: join, create the group, run ``train()`` under the monitor.

Called by the restart loop (``inprocess.restart.loop``) on the main thread, once per iteration in
which this rank is active. The iteration's start (join barrier, group, ready barrier) is here
too: the group is created inside ``_call_train``'s handlers, once the monitor runs. Every wait
here is bounded (``barrier_timeout``, ``completion_timeout``) or ends with the outcome.
"""

from __future__ import annotations

import functools
import logging
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from restartable.inprocess.context import RestartContext, RestartRecord, activated
from restartable.inprocess.errors import RestartInterrupt
from restartable.inprocess.protocol import barriers, fault_records, iteration_end, keys
from restartable.inprocess.protocol.ranks import Assignment
from restartable.inprocess.protocol.sealed_store import unsealed
from restartable.inprocess.protocol.store import Store
from restartable.inprocess.restart.abort import drop_frames
from restartable.inprocess.restart.interrupter import disarm
from restartable.inprocess.restart.monitor import Monitor, MonitorLimits
from restartable.inprocess.restart.process_group import init_iteration_group, own_group_misuse
from restartable.inprocess.restart.raised import raise_site, raised_in_collective, report_raised
from restartable.inprocess.restart.services import RankServices

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Outcome:
    """How one iteration ended for this rank (active or reserve)."""

    done: bool
    value: Any = None
    noticed: float = 0.0  # wall clock when this rank learnt of the fault
    abort_s: float = 0.0
    unwind_s: float = 0.0


@dataclass
class _Call:
    """What happened inside one call of ``train()``."""

    value: Any = None
    exc: Exception | None = None
    where: str = ""  # file:line of the raise, read before the traceback's frames are dropped
    trace: str = ""  # the formatted traceback (the rank's own exception only), read then too
    in_collective: bool = False  # a failed communication (raised.raised_in_collective)
    interrupted: bool = False
    delivered: bool = False
    t_unwind: float = 0.0


def run_active(
    svc: RankServices,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    iteration: int,
    assignment: Assignment,
    rank: int,
    on_started: Callable[[float], RestartRecord | None],
) -> Outcome:
    """Join, run ``train()`` as ``rank`` of ``assignment``, then complete or report the fault.

    ``on_started(reinit_s)`` runs once the group exists, just before ``train()`` (the loop logs
    the restart that led here and returns its record for ``ctx.last_restart``).
    """
    world = len(assignment.active)
    t_reinit = svc.clock.monotonic()
    if not _join(svc, iteration, assignment):
        return Outcome(done=False, noticed=svc.clock.wall())
    ctx = _context(svc, iteration, assignment, rank)
    monitor = _new_monitor(svc, ctx)

    def start() -> None:
        # Inside _call_train's handlers: a peer's fault may be delivered as soon as the
        # monitor's store thread runs, before the second thread has even started.
        monitor.start()
        _create_group(svc, iteration, rank, assignment.active)
        ctx.last_restart = on_started(svc.clock.monotonic() - t_reinit)

    train = functools.partial(_train_once, svc, rank, fn, args, kwargs)
    svc.sections.begin_iteration(writer=rank == 0)
    svc.progress.stamp()
    svc.interrupter.arm()
    try:
        call = _call_train(svc, ctx, train, start)
    except BaseException as e:  # SystemExit, KeyboardInterrupt: this rank leaves the job
        _left_job(svc, ctx, e)
        monitor.close()
        raise
    try:
        return _settle(svc, ctx, monitor, call, world)
    finally:
        monitor.close()


def _join(svc: RankServices, iteration: int, assignment: Assignment) -> bool:
    """The iteration's join barrier (blocks up to ``barrier_timeout``); False when a rank of
    ``assignment`` is gone meanwhile (the iteration is over before it began)."""
    with svc.progress.paused():
        svc.rendezvous.prepare(host=assignment.active[0])  # before joining: see its docstring
        return barriers.join_barrier(
            svc.store,
            iteration,
            expected=len(assignment.active),
            timeout=svc.config.barrier_timeout,
            clock=svc.clock,
            recheck=functools.partial(_break_if_gone, svc.store, iteration, assignment.active),
        )


def _create_group(svc: RankServices, iteration: int, rank: int, active: tuple[int, ...]) -> None:
    """The iteration's group, then the ready barrier: nobody trains before every rank joined.

    A rank still inside gloo's connect when a peer faults could not be released until the
    init timeout. Run by ``run_active``'s ``start``, inside ``_call_train``'s handlers.
    """
    world, host = len(active), active[0]
    try:
        init_iteration_group(
            svc.config,
            svc.rendezvous.store(host),
            iteration=iteration,
            rank=rank,
            world_size=world,
            local_rank=svc.local_rank,
        )
    except BaseException:
        svc.rendezvous.forget(host)  # the host may be gone: connect afresh next time
        raise
    if not svc.config.init_process_group:
        return
    with svc.progress.paused():
        if svc.rendezvous.hosted:
            # On etcd the store barrier costs two consensus round trips and a watch; a barrier
            # of the new group itself gives the same guarantee (it completes only once every
            # rank has the group) in a millisecond, and a peer that faults meanwhile tears its
            # group down, which fails this barrier at once, as it fails any collective.
            _group_barrier()
            return
        ready = barriers.ready_barrier(
            svc.store,
            iteration,
            expected=world,
            timeout=svc.config.barrier_timeout,
            clock=svc.clock,
        )
    if not ready:
        raise RestartInterrupt("a rank faulted while the group was created")


def _group_barrier() -> None:
    """``dist.barrier()`` on the default group (NCCL: on this rank's current device)."""
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()


def _break_if_gone(store: Store, iteration: int, active: tuple[int, ...]) -> bool:
    """Join recheck: an active rank that died during the restart breaks the barrier."""
    dead = keys.gone_ranks(store) & set(active)
    for r in sorted(dead):
        fault_records.report_fault(
            store,
            iteration=iteration,
            initial_rank=r,
            kind="dead",
            detail="lost during the restart",
        )
    return bool(dead)


def _context(
    svc: RankServices, iteration: int, assignment: Assignment, rank: int
) -> RestartContext:
    """What ``train()`` sees of this iteration (``inprocess.context()``): its place, and a
    store namespace of its own over the job's store, unsealed (the user's values are theirs)."""
    return RestartContext(
        iteration=iteration,
        rank=rank,
        world_size=len(assignment.active),
        initial_rank=svc.me,
        active_ranks=assignment.active,
        store=dist.PrefixStore(keys.pg_prefix(iteration) + "/user", unsealed(svc.store)),
        last_restart=None,
        _progress=svc.progress,
        _interrupter=svc.interrupter,
        _sections=svc.sections,
        _clock=svc.clock,
    )


def _left_job(svc: RankServices, ctx: RestartContext, exc: BaseException) -> None:
    """``train()`` raised a ``BaseException`` (SystemExit, KeyboardInterrupt): record this rank
    dead, so that the others restart without it (the loop re-raises)."""
    svc.sections.end_iteration()
    fault_records.report_fault(
        svc.store,
        iteration=ctx.iteration,
        initial_rank=svc.me,
        kind="dead",
        detail=f"left the job: {exc!r}",
        step=ctx.step,
    )


def _new_monitor(svc: RankServices, ctx: RestartContext) -> Monitor:
    """This iteration's monitor (not started), on a client of the pool (handed back by it)."""
    return Monitor(
        store=svc.clients.take(),
        give_back=svc.clients.give,
        report_store=svc.report_store,
        iteration=ctx.iteration,
        initial_rank=svc.me,
        limits=MonitorLimits.of(svc.config),
        progress=svc.progress,
        interrupter=svc.interrupter,
        abort=svc.abort,
        step=lambda: ctx.step,
        sections=svc.sections,
        clock=svc.clock,
    )


def _train_once(
    svc: RankServices,
    rank: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """``fn(*args, **kwargs)``, called by ``_call_train`` on the main thread; restores autograd's
    mode if the unwinding left it changed, and names a misuse of the iteration's group."""
    # Sections are judged only while train() runs: the completion wait that follows is
    # the framework's, bounded by completion_timeout.
    grad_enabled = torch.is_grad_enabled()
    try:
        return fn(*args, **kwargs)
    except BaseException as exc:
        # The restart exception is raised asynchronously: it can land e.g. at the start of
        # the __exit__ of a `with torch.no_grad():` block that a failed collective is
        # unwinding, and autograd then stays off in this thread for every later iteration
        # (seen: the example's rank 0 on an H200 host, torch 2.11, failed every iteration
        # after the first restart with "element 0 of tensors does not require grad").
        if torch.is_grad_enabled() != grad_enabled:
            log.info(
                "rank %d: train() unwound with autograd %s; turned it %s again",
                rank,
                "off" if grad_enabled else "on",
                "on" if grad_enabled else "off",
            )
            torch.set_grad_enabled(grad_enabled)
        misuse = own_group_misuse(exc)
        if misuse is not None:
            raise misuse from exc
        raise
    finally:
        svc.sections.end_iteration()


def _call_train(
    svc: RankServices, ctx: RestartContext, train: Callable[[], Any], start: Callable[[], None]
) -> _Call:
    """Run ``start()`` and ``train()``; every outcome but a ``BaseException`` is returned.

    The restart is a ``RestartInterrupt`` delivered asynchronously by the monitor: it can land
    in the handlers below as well, before the disarm, hence the outer ``except``.
    """
    call = _Call()
    try:
        try:
            start()
            with activated(ctx):
                call.value = train()
        except RestartInterrupt as ri:
            call.interrupted = True
            drop_frames(ri)
            call.t_unwind = svc.clock.monotonic()
        except Exception as e:
            call.exc, call.where = e, raise_site(e)
            call.in_collective = raised_in_collective(e)
            if not call.in_collective:  # logged with it by _settle; a peer's echo is one line
                call.trace = "".join(traceback.format_exception(e)).rstrip()
            drop_frames(e)
        finally:
            call.delivered = disarm(svc.interrupter)
    except RestartInterrupt:
        call.interrupted = True
        call.t_unwind = call.t_unwind or svc.clock.monotonic()
        call.delivered = disarm(svc.interrupter)
    except BaseException:
        disarm(svc.interrupter)
        raise
    return call


def _settle(
    svc: RankServices, ctx: RestartContext, monitor: Monitor, call: _Call, world: int
) -> Outcome:
    """After ``train()``: report its exception, tear the group down, then complete or not."""
    clock = svc.clock
    noticed = monitor.fired_at or clock.wall()
    if call.exc is not None:
        _report_raised(svc, ctx, call)
        noticed = clock.wall()
    t0 = clock.monotonic()
    svc.abort()
    abort_s = monitor.abort_s or clock.monotonic() - t0
    svc.release()
    unwind_s = clock.monotonic() - call.t_unwind if call.interrupted else 0.0
    if call.exc is None and not call.interrupted and not call.delivered:
        if _complete(svc, ctx, world):
            return Outcome(done=True, value=call.value)
        noticed = clock.wall()
    if svc.config.empty_cuda_cache and torch.cuda.is_available():
        torch.cuda.empty_cache()
    return Outcome(done=False, noticed=noticed, abort_s=abort_s, unwind_s=unwind_s)


def _report_raised(svc: RankServices, ctx: RestartContext, call: _Call) -> None:
    """Log the exception ``train()`` raised (``inprocess.restart.raised``), record its fault."""
    assert call.exc is not None
    record = report_raised(
        svc.store,
        call.exc,
        me=svc.me,
        iteration=ctx.iteration,
        step=ctx.step,
        where=call.where,
        trace=call.trace,
        in_collective=call.in_collective,
        clock=svc.clock,
    )
    fault_records.record_fault(svc.store, record)


def _complete(svc: RankServices, ctx: RestartContext, world: int) -> bool:
    """``train()`` returned: mark this rank completed and wait (up to ``completion_timeout``)
    for the iteration's outcome. True when every rank completed; on a timeout, reports it."""
    cfg, store, iteration = svc.config, svc.store, ctx.iteration
    iteration_end.mark_completed(store, iteration, active=world)
    with svc.progress.paused():
        result = iteration_end.wait_outcome(
            store, iteration, timeout=cfg.completion_timeout, clock=svc.clock
        )
    if result == keys.OUTCOME_DONE:
        return True
    if result is None:
        fault_records.report_fault(
            store,
            iteration=iteration,
            initial_rank=svc.me,
            kind="completion_timeout",
            detail="other ranks did not finish within completion_timeout "
            f"({cfg.completion_timeout} s)",
            step=ctx.step,
        )
    return False
