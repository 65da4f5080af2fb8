"""An exception ``train()`` raised on this rank: whose fault it looks like, and how it is logged.

Called by ``inprocess.restart.active`` on the main thread after ``train()`` raised, before the
fault is recorded in the store. A failed communication inside a collective is most likely a
peer's fault (one WARNING line; the restart decision judges); anything else, even raised inside
torch.distributed's code (a ``NotImplementedError`` from DTensor's dispatch on every rank), is
the rank's own error: ERROR with the user's traceback, once per distinct error and iteration.
"""

from __future__ import annotations

import hashlib
import logging

import torch.distributed as dist

from restartable.inprocess.clock import SYSTEM, Clock
from restartable.inprocess.errors import FaultRecord
from restartable.inprocess.protocol import iteration_end, keys
from restartable.inprocess.protocol.store import Store
from restartable.inprocess.restart.thread_stack import waits_on_peers

log = logging.getLogger(__name__)

# Exception types that say "the communication failed" (gloo and NCCL raise RuntimeError or a
# torch.distributed.DistError; a socket, OSError). Their subclasses that say "this code is
# wrong" are not: NotImplementedError and RecursionError derive from RuntimeError.
_COMMUNICATION = (RuntimeError, OSError)
_NOT_COMMUNICATION = (NotImplementedError, RecursionError)
_FIRST_WAIT_S = 1.0  # bound of the wait for the rank that logs a shared error's traceback


def raised_in_collective(exc: BaseException) -> bool:
    """Whether ``exc`` is a failed communication: a torch.distributed error type, or a
    communication error type raised where a rank waits on its peers
    (``inprocess.restart.thread_stack.waits_on_peers``), itself not raised ``from`` an error of
    another kind or place. Only raise sites count: a user's error in a model's forward passes
    through DDP's forward too, but is raised in the model; DTensor's dispatch re-raises an
    operator's error as a ``RuntimeError`` in torch.distributed's code ``from`` the original.

    Reads ``exc``'s traceback: call it before its frames are dropped.
    """
    if isinstance(exc, dist.DistError):
        return True
    root = exc
    while root.__cause__ is not None:  # "raise ... from": explicit, unlike __context__
        root = root.__cause__
    return (
        waits_on_peers(raise_site(root))
        and isinstance(root, _COMMUNICATION)
        and not isinstance(root, _NOT_COMMUNICATION)
    )


def raise_site(exc: BaseException) -> str:
    """``file:line`` of the innermost frame of ``exc``'s traceback (the raise)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}" if tb is not None else ""


def report_raised(
    store: Store,
    exc: Exception,
    *,
    me: int,
    iteration: int,
    step: int | None,
    where: str,
    trace: str,
    in_collective: bool,
    clock: Clock = SYSTEM,
) -> FaultRecord:
    """Log ``exc`` once at the level its kind deserves (a peer's fault in a collective:
    WARNING; a verdict: INFO; the rank's own error: ERROR with ``trace``, the traceback
    formatted before its frames were dropped) and return its fault record (not yet stored)."""
    record = exception_record(
        exc,
        iteration=iteration,
        initial_rank=me,
        step=step,
        where=where,
        in_collective=in_collective,
        after_fault=iteration_end.outcome(store, iteration) == keys.OUTCOME_FAULT,
        clock=clock,
    )
    if record.in_collective:  # most likely a peer's fault; the restart decision judges
        log.warning(
            "rank %d: a collective failed in iteration %d: %s", me, iteration, record.detail
        )
    elif hasattr(exc, "restartable_rank_action"):
        # A verdict handed to the restart on purpose (rerun's RerunExit: a NaN re-run and
        # judged): the designed path, not a failure to log with a traceback.
        log.info(
            "rank %d: train() handed a verdict to the restart in iteration %d: %s",
            me,
            iteration,
            record.detail,
        )
    else:
        first = _first_to_log(store, record, clock)
        _log_own(exc, trace, rank=me, iteration=iteration, first=first)
    return record


def _first_to_log(store: Store, record: FaultRecord, clock: Clock) -> int:
    """The initial rank that logs the traceback of this error (type and raise site) in this
    iteration: the first to claim it in the store (an atomic add; ranks that hit the same bug
    raise it at the same moment, so reading the recorded faults first would race)."""
    what = hashlib.sha256(f"{record.exc_type} {record.where}".encode()).hexdigest()[:16]
    key = f"{keys.iteration_prefix(record.iteration)}traceback/{what}"
    if store.add(key, 1) == 1:
        store.set(f"{key}/rank", str(record.initial_rank))
        return record.initial_rank
    # The first claimer sets its rank right after its add: a short bounded wait.
    got = keys.peek(store, f"{key}/rank")
    deadline = clock.monotonic() + _FIRST_WAIT_S
    while got is None and clock.monotonic() < deadline:
        clock.sleep(0.005)
        got = keys.peek(store, f"{key}/rank")
    return int(got) if got is not None else -1


def _log_own(exc: Exception, trace: str, *, rank: int, iteration: int, first: int) -> None:
    """ERROR with the traceback of the exception ``train()`` raised on this rank; one line
    when another rank already recorded the same error (type and raise site) in this iteration
    (every rank hitting the same bug prints one traceback, not one per rank).

    The traceback's frames are already dropped (they hold the process group), so the text
    formatted before goes in as the record's ``exc_text``, which every ``logging.Formatter``
    prints (Python's last-resort handler too, when the script configured no logging);
    ``exc_info`` still carries the exception for formatters that print one line.
    """
    if not log.isEnabledFor(logging.ERROR):
        return
    if first != rank:
        log.error(
            "rank %d: train() raised in iteration %d the same error as rank %s, whose "
            "traceback is logged: %s",
            rank,
            iteration,
            first if first >= 0 else "another",
            f"{type(exc).__name__}: {exc}".splitlines()[0][:300],
        )
        return
    record = log.makeRecord(
        log.name,
        logging.ERROR,
        __file__,
        0,
        "rank %d: train() raised in iteration %d",
        (rank, iteration),
        (type(exc), exc, None),
    )
    record.exc_text = trace or None
    log.handle(record)


def exception_record(
    exc: BaseException,
    *,
    iteration: int,
    initial_rank: int,
    step: int | None,
    where: str,
    in_collective: bool,
    after_fault: bool,
    clock: Clock = SYSTEM,
) -> FaultRecord:
    """The fault record of an exception raised out of ``train()``, with the evidence the restart
    policy uses to tell the rank's own fault from a consequence of a peer's."""
    action = getattr(exc, "restartable_rank_action", "")
    return FaultRecord(
        iteration=iteration,
        initial_rank=initial_rank,
        kind="exception",
        detail=f"{type(exc).__name__}: {exc}"[:500],
        exc_type=f"{type(exc).__module__}.{type(exc).__qualname__}",
        where=where,
        step=step,
        action=action if action in ("demote", "retire") else "",
        time=clock.wall(),
        in_collective=in_collective,
        after_fault=after_fault,
    )
