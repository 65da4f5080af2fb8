"""One iteration of an active rank: join, create the group, run ``train()`` under the monitor.

Called by the restart loop (``inprocess.restart.loop``) on the main thread, once per iteration in
which this rank is active. Every wait here is bounded (``barrier_timeout``,
``completion_timeout``) or ends with the iteration's outcome.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from inprocess.clock import SYSTEM
from inprocess.config import RestartConfig
from inprocess.context import RestartContext, RestartRecord, activated
from inprocess.errors import RestartInterrupt
from inprocess.protocol import barriers, fault_records, iteration_end, keys
from inprocess.protocol.ranks import Assignment
from inprocess.protocol.sealed_store import unsealed
from inprocess.protocol.store import Store
from inprocess.restart.monitor import Interrupter, Monitor
from inprocess.restart.process_group import init_iteration_group, own_group_misuse
from inprocess.restart.progress import ProgressTracker
from inprocess.restart.raised import raise_site, raised_in_collective, report_raised
from inprocess.restart.rendezvous import Rendezvous
from inprocess.timeouts.sections import SectionClock

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Outcome:
    """How one iteration ended for this rank (active or reserve)."""

    done: bool
    value: Any = None
    noticed: float = 0.0  # time.time() this rank learnt of the fault
    abort_s: float = 0.0
    unwind_s: float = 0.0


@dataclass(frozen=True)
class RankServices:
    """What the loop owns and lends to every iteration of this rank (the loop closes them).

    ``abort`` tears down this rank's groups and keeps them for ``release`` (monitor or main
    thread); ``release`` hands them to the reaper once ``train()``'s frames are gone;
    ``new_client`` opens a store client for a blocking wait, and ``clients`` keeps the
    monitors' clients between iterations; ``sections`` times ``ctx.section()`` and keeps the
    learned timeouts across iterations; ``rendezvous`` gives the store each iteration's group
    is created over.
    """

    config: RestartConfig
    me: int
    local_rank: int
    store: Store
    report_store: Store
    new_client: Callable[[], Any]
    progress: ProgressTracker
    interrupter: Interrupter
    abort: Callable[[], None]
    release: Callable[[], None]
    sections: SectionClock
    rendezvous: Rendezvous
    clients: ClientPool


class ClientPool:
    """Idle store clients for the monitors' blocking waits, kept across iterations.

    Opening a client costs a connect (an etcd client: a request, 4-12 ms measured on the
    restart path); the monitor's store thread hands its client back once its wait ended with
    the iteration's outcome, so the next iteration's monitor starts without a connect. A
    client whose wait did not end (a rank that leaves mid-iteration) is never handed back.
    Thread-safe.
    """

    def __init__(self, open_client: Callable[[], Any]) -> None:
        self._open = open_client
        self._idle: list[Any] = []
        self._lock = threading.Lock()

    def take(self) -> Any:
        """An idle client, or a new one (may block on the connect, bounded by its timeout)."""
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return self._open()

    def give(self, client: Any) -> None:
        """Hand back a client with no call in flight."""
        with self._lock:
            self._idle.append(client)

    def close(self) -> None:
        """Close the idle clients (end of the job; idempotent)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for c in idle:
            close = getattr(c, "close", None)  # EtcdStore holds HTTP connections
            if close is not None:
                close()


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
    t_reinit = time.monotonic()
    if not _join(svc, iteration, assignment):
        return Outcome(done=False, noticed=time.time())
    ctx = RestartContext(
        iteration=iteration,
        rank=rank,
        world_size=world,
        initial_rank=svc.me,
        active_ranks=assignment.active,
        store=dist.PrefixStore(keys.pg_prefix(iteration) + "/user", unsealed(svc.store)),
        last_restart=None,
        _progress=svc.progress,
        _interrupter=svc.interrupter,
        _sections=svc.sections,
    )
    monitor = _new_monitor(svc, ctx)

    def start() -> None:
        # Inside _call_train's handlers: a peer's fault may be delivered as soon as the
        # monitor's store thread runs, before the second thread has even started.
        monitor.start()
        _create_group(svc, iteration, rank, assignment.active)
        ctx.last_restart = on_started(time.monotonic() - t_reinit)

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
            clock=SYSTEM,
            recheck=functools.partial(_break_if_gone, svc.store, iteration, assignment.active),
        )


def _new_monitor(svc: RankServices, ctx: RestartContext) -> Monitor:
    """This iteration's monitor (not started), on a client of the pool (handed back by it)."""
    cfg = svc.config
    return Monitor(
        store=svc.clients.take(),
        give_back=svc.clients.give,
        report_store=svc.report_store,
        iteration=ctx.iteration,
        initial_rank=svc.me,
        soft_timeout=cfg.soft_timeout,
        progress=svc.progress,
        interrupter=svc.interrupter,
        abort=svc.abort,
        step=lambda: ctx.step,
        check_interval=min(1.0, cfg.soft_timeout / 10),
        redeliver_interval=max(0.5, min(5.0, cfg.soft_timeout / 2)),
        sections=svc.sections,
        # A rank frozen that long is lost (hard_timeout's meaning); an atomic block, too.
        atomic_timeout=cfg.hard_timeout,
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


def _create_group(svc: RankServices, iteration: int, rank: int, active: tuple[int, ...]) -> None:
    """The iteration's group, then the ready barrier: nobody trains before every rank joined.

    A rank still inside gloo's connect when a peer faults could not be released until the
    init timeout.
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
            clock=SYSTEM,
        )
    if not ready:
        raise RestartInterrupt("a rank faulted while the group was created")


def _group_barrier() -> None:
    """``dist.barrier()`` on the default group (NCCL: on this rank's current device)."""
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()


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
            _drop_frames(ri)
            call.t_unwind = time.monotonic()
        except Exception as e:
            call.exc, call.where = e, raise_site(e)
            call.in_collective = raised_in_collective(e)
            if not call.in_collective:  # logged with it by _settle; a peer's echo is one line
                call.trace = "".join(traceback.format_exception(e)).rstrip()
            _drop_frames(e)
        finally:
            call.delivered = disarm(svc.interrupter)
    except RestartInterrupt:
        call.interrupted = True
        call.t_unwind = call.t_unwind or time.monotonic()
        call.delivered = disarm(svc.interrupter)
    except BaseException:
        disarm(svc.interrupter)
        raise
    return call


def _settle(
    svc: RankServices, ctx: RestartContext, monitor: Monitor, call: _Call, world: int
) -> Outcome:
    """After ``train()``: report its exception, tear the group down, then complete or not."""
    noticed = monitor.fired_at or time.time()
    if call.exc is not None:
        _report_raised(svc, ctx, call)
        noticed = time.time()
    t0 = time.monotonic()
    svc.abort()
    abort_s = monitor.abort_s or time.monotonic() - t0
    svc.release()
    unwind_s = time.monotonic() - call.t_unwind if call.interrupted else 0.0
    if call.exc is None and not call.interrupted and not call.delivered:
        if _complete(svc, ctx, world):
            return Outcome(done=True, value=call.value)
        noticed = time.time()
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
    )
    fault_records.record_fault(svc.store, record)


def _complete(svc: RankServices, ctx: RestartContext, world: int) -> bool:
    """``train()`` returned: mark this rank completed and wait (up to ``completion_timeout``)
    for the iteration's outcome. True when every rank completed; on a timeout, reports it."""
    cfg, store, iteration = svc.config, svc.store, ctx.iteration
    iteration_end.mark_completed(store, iteration, active=world)
    with svc.progress.paused():
        result = iteration_end.wait_outcome(
            store, iteration, timeout=cfg.completion_timeout, clock=SYSTEM
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


def disarm(interrupter: Interrupter) -> bool:
    """Stop the monitor's deliveries; a delivery racing with this call is absorbed."""
    while True:
        try:
            return interrupter.disarm()
        except RestartInterrupt:
            continue


def _drop_frames(exc: BaseException) -> None:
    """Release the locals of ``train()``'s frames held by ``exc``'s traceback.

    A collective that raised leaves its frame (holding the process group) in the traceback; as
    long as it lives, destroying the group does not close its sockets, and peers blocked on
    this rank are not released. What the fault record needs from the traceback (the raise site)
    is read before this.
    """
    log.debug("train() unwound", exc_info=exc) if log.isEnabledFor(logging.DEBUG) else None
    # The exceptions it was raised from or during (__cause__, __context__) carry tracebacks
    # through the same frames.
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        chained = todo.pop()
        if chained is None or id(chained) in seen:
            continue
        seen.add(id(chained))
        traceback.clear_frames(chained.__traceback__)
        chained.__traceback__ = None
        todo += [chained.__cause__, chained.__context__]
