"""Demotion asked from inside ``train()``: a slow rank steps back to the reserve pool.

Called by ``RestartContext.replace_rank`` (the ``straggler`` package calls that, never this
module: it imports nothing of ``inprocess``). The rank to replace records a fault of kind
``straggler`` with action ``demote`` in the iteration, which ends the iteration like any fault:
every rank's monitor interrupts ``train()``, and the restart decision
(``inprocess.protocol.policy``)
moves that rank to the back of the reserve pool while a reserve takes its place. Such a fault is
not counted against the rank (``max_rank_faults``, the repeated-fault stop): it works, it is
slow.
"""

from __future__ import annotations

import datetime
import logging
from typing import Protocol

import torch.distributed as dist

from restartable.checkpoint.sealing import job_sealer
from restartable.inprocess.clock import SYSTEM, Clock
from restartable.inprocess.errors import FaultRecord
from restartable.inprocess.protocol import fault_records, keys
from restartable.inprocess.protocol.sealed_store import seal
from restartable.inprocess.protocol.store import Store

log = logging.getLogger(__name__)

STRAGGLER_KIND = "straggler"
# How long a recorded request waits for the restart to interrupt train() (it takes
# milliseconds: the monitor wakes on the store). Bounded so that a lost delivery cannot hang.
INTERRUPT_WAIT_S = 30.0
_POLL_S = 0.005
# Under ctx.store (the iteration's user namespace): the deciding rank's answer per call.
DECISION_PREFIX = "inprocess/demotion/"


class DemotionContext(Protocol):
    """What a demotion reads of the restart context: ``inprocess.context.RestartContext``
    satisfies it (this module does not import that one, which calls into this one)."""

    @property
    def iteration(self) -> int: ...
    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def initial_rank(self) -> int: ...
    @property
    def step(self) -> int | None: ...
    @property
    def store(self) -> dist.Store: ...  # the iteration's namespace (a PrefixStore)


def free_reserves(store: Store, iteration: int) -> tuple[int, ...]:
    """The reserves of ``iteration`` whose process is still there (initial ranks); never blocks."""
    gone = keys.gone_ranks(store)
    return tuple(r for r in keys.reserves(store, iteration) if r not in gone)


def replace_rank(
    ctx: DemotionContext,
    rank: int,
    *,
    reason: str,
    tag: str,
    wait: float = INTERRUPT_WAIT_S,
    clock: Clock = SYSTEM,
) -> bool:
    """Swap training rank ``rank`` (``ctx.rank`` numbering) for a warm reserve, now.

    Collective in the loose sense: every active rank calls it with the same arguments (the same
    published straggler report), and every rank gets the same answer. ``tag`` names the call
    (e.g. the report round): unique within the iteration. The rank to replace decides: no
    warm reserve free -> it publishes "no" and every rank returns False (the job goes on as it
    is). Otherwise it records a fault of kind ``straggler`` with action ``demote``, which ends
    the iteration, and every rank waits (in Python, so the restart can be delivered) until the
    restart interrupts ``train()`` here: normally the call does not return. Why every rank
    waits: a rank that went on into the next step's collective would block in C, where the
    restart cannot reach it, and a gloo peer blocked there is released only by the group
    timeout. Every wait is bounded by ``wait`` seconds (True after that: no restart came).
    """
    if not 0 <= rank < ctx.world_size:
        raise ValueError(
            f"rank ({rank}) must be a training rank of this iteration (0..{ctx.world_size - 1})"
        )
    job = _job_store(ctx)
    decisions = seal(ctx.store, job_sealer(create=False))  # the answer is sealed too
    key = f"{DECISION_PREFIX}{tag}"
    if ctx.rank == rank:
        granted = _decide(ctx, job, decisions, key, reason=reason, clock=clock)
    else:
        try:
            ctx.store.wait([key], datetime.timedelta(seconds=wait))
        except Exception as exc:  # the store's timeout: the deciding rank is gone
            log.warning("rank %d: no demotion decision for rank %d: %r", ctx.rank, rank, exc)
            return False
        granted = decisions.get(key) == b"yes"
    if not granted:
        return False
    deadline = clock.monotonic() + wait
    while clock.monotonic() < deadline:
        clock.sleep(_POLL_S)  # the RestartInterrupt lands between two sleeps
    if wait > 0:
        log.error("rank %d: no restart within %.1f s of the demotion", ctx.rank, wait)
    return True


def _decide(
    ctx: DemotionContext, job: Store, decisions: Store, key: str, *, reason: str, clock: Clock
) -> bool:
    """The rank to replace decides (``replace_rank``): publishes "yes" when a warm reserve is
    free and records its own ``straggler`` fault (action ``demote``), else "no"."""
    granted = bool(free_reserves(job, ctx.iteration))
    decisions.set(key, "yes" if granted else "no")
    if granted:
        fault_records.record_fault(
            job,
            FaultRecord(
                iteration=ctx.iteration,
                initial_rank=ctx.initial_rank,
                kind=STRAGGLER_KIND,
                detail=reason[:500],
                step=ctx.step,
                action="demote",
                time=clock.wall(),
            ),
        )
        log.warning(
            "rank %d (initial rank %d) to be replaced by a warm reserve in iteration %d: %s",
            ctx.rank,
            ctx.initial_rank,
            ctx.iteration,
            reason,
        )
    return granted


def _job_store(ctx: DemotionContext) -> Store:
    """The job's store under ``ctx.store`` (the wrapper builds ``ctx.store`` as a PrefixStore
    of the iteration's user namespace over it; fault records live outside that namespace),
    with the job's values sealed (``inprocess.protocol.sealed_store``)."""
    import torch.distributed as dist  # loaded already: ctx.store is torch's

    if not isinstance(ctx.store, dist.PrefixStore):
        raise RuntimeError(
            "replace_rank needs the restart context that @restartable built (its store "
            f"is a PrefixStore over the job's store), not {type(ctx.store).__name__}"
        )
    return seal(ctx.store.underlying_store, job_sealer(create=False))
