"""Firing a fault: claim it once, record it, then act (``inject`` reads the restart context)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence

from restartable.inprocess import journal
from restartable.inprocess.clock import SYSTEM, Clock
from restartable.inprocess.context import context
from restartable.inprocess.errors import ConfigError
from restartable.inprocess.faults.kinds import SLOW_FACTOR, act, kind_of
from restartable.inprocess.faults.plan import PlannedFault
from restartable.inprocess.faults.record import FiredFault, fired, record_once

log = logging.getLogger(__name__)


def trigger(
    fault: PlannedFault,
    *,
    record_dir: str | os.PathLike[str] | None,
    initial_rank: int,
    iteration: int,
    step: int | None,
    clock: Clock = SYSTEM,
) -> bool:
    """Fire ``fault`` now, on rank ``fault.rank``, unless it fired before.

    With ``record_dir``: claim the fault (once per directory; False if it was claimed before),
    then append its record (fsynced), then fire it. Without: fire it, unrecorded, every call.
    Returns True when the fault is due and this call returns: a ``numeric`` kind (``nan``),
    which the caller must apply now, a ``lasting`` one (``slow``), which the caller applies from
    now on (``slowdown``), or a ``sigterm`` that a handler caught. The other kinds do not
    return. Needs no ``context()``: the caller says where it runs. ``clock``: the record's
    time (``clock.wall()``) and a ``hang``'s sleep.
    """
    kind = kind_of(fault.kind)
    record = FiredFault(
        fault=fault.name,
        kind=kind.name,
        rank=fault.rank,
        initial_rank=initial_rank,
        iteration=iteration,
        step=step,
        time=clock.wall(),
        pid=os.getpid(),
    )
    if record_dir is not None and not record_once(record_dir, record):
        return False
    journal.record("fault_fired", fault=fault.name, kind=kind.name, iteration=iteration, step=step)
    log.warning(
        "injecting fault %s (initial rank %d, iteration %d, step %s)",
        fault.name,
        initial_rank,
        iteration,
        step,
    )
    if not (kind.numeric or kind.lasting):  # those are the caller's to apply
        act(kind, detail=fault.name, clock=clock)
    return True


def inject(
    kind: str,
    *,
    rank: int,
    iteration: int | None = None,
    step: int | None = None,
    current_step: int | None = None,
    record_dir: str | os.PathLike[str] | None = None,
) -> bool:
    """Fire fault ``kind`` now if this is ``rank`` (``ctx.rank``) in ``iteration`` at ``step``.

    Call inside a ``@restartable`` function. None for ``iteration``/``step`` matches any.
    ``record_dir``: record the fault there before it fires, and fire it at most once per
    directory (see ``trigger``). Returns False when it did not fire; True for a ``nan`` that is
    due (apply it to the loss now) or a ``sigterm`` that a handler caught; the other kinds do
    not return.
    """
    kind_of(kind)  # a bad kind is an error on every rank, not only on the one that matches
    ctx = context()
    if ctx.rank != rank:
        return False
    if iteration is not None and ctx.iteration != iteration:
        return False
    if step is not None and current_step != step:
        return False
    return trigger(
        PlannedFault(kind, rank, step, iteration),
        record_dir=record_dir,
        initial_rank=ctx.initial_rank,
        iteration=ctx.iteration,
        step=current_step,
    )


def fire_planned(
    plan: Sequence[PlannedFault], *, step: int, record_dir: str | os.PathLike[str]
) -> PlannedFault | None:
    """Fire the faults of ``plan`` due on this rank (``ctx.rank``) at ``step``, each once per run.

    Call inside a ``@restartable`` function at the start of each step. Returns the ``nan``
    fault due now (recorded; multiply the loss by NaN), or None. The faults that end the step
    (``exception``, ``kill``, ...) fire before a ``nan`` is claimed, so a ``nan`` planned at the
    same step is applied in the replay instead of lost.
    """
    ctx = context()
    due = [
        f
        for f in plan
        if f.rank == ctx.rank and f.step == step and f.iteration in (None, ctx.iteration)
    ]
    numeric = None
    for fault in sorted(due, key=lambda f: kind_of(f.kind).numeric):
        fired = trigger(
            fault,
            record_dir=record_dir,
            initial_rank=ctx.initial_rank,
            iteration=ctx.iteration,
            step=step,
        )
        if fired and kind_of(fault.kind).numeric:
            numeric = fault  # at most one: a plan has no repeated item
    return numeric


def fire(kind: str, *, detail: str = "") -> None:
    """Fire fault ``kind`` in this process now, unconditionally and unrecorded.

    Prefer ``inject``/``trigger`` with a ``record_dir``: only recorded faults can be counted.
    """
    resolved = kind_of(kind)
    if resolved.numeric or resolved.lasting:
        raise ConfigError(
            f"kind ({kind!r}) is applied by the caller to its own value, not fired: use "
            "inject() or fire_planned(), which say when it is due"
        )
    act(resolved, detail=detail or resolved.name)


def slowdown(record_dir: str | os.PathLike[str]) -> float:
    """How many times slower this process's compute must run: ``SLOW_FACTOR`` once a ``slow``
    fault fired in this process (recorded in ``record_dir``), else 1.0.

    Reads the record file: call it when the step's faults fired (``fire_planned``) and at the
    start of ``train()``, not on every step. Survives in-process restarts (the record keeps the
    pid), and a reserve that takes the slow rank's place is not slow.
    """
    me = os.getpid()
    slow = any(f.kind == "slow" and f.pid == me for f in fired(record_dir))
    return SLOW_FACTOR if slow else 1.0


def burn(cpu_seconds: float) -> None:
    """Keep this process's CPU busy for ``cpu_seconds`` of process CPU time (a slow rank's extra
    compute: ``burn((slowdown(d) - 1) * compute_s)``). A sleep would not do: a straggler detector
    times compute by CPU time, as a slow GPU's kernels take longer, not idle longer."""
    end = time.process_time() + cpu_seconds
    while time.process_time() < end:
        pass
