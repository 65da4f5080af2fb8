"""The fault windows of one launch's downtime report: every restart (in-process, in-job), when
its fault showed, was detected, and when rank 0 was back (the terms are defined in
``inprocess.report.downtime``'s docstring). Pure; no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from restartable.inprocess.report.terms import IN_JOB, IN_PROCESS, Window
from restartable.inprocess.restart.restored import phrase


@dataclass
class _Candidate:
    """A restart before merging with the window it may fall into."""

    iteration: int
    round: int
    level: str
    rec: dict[str, Any]  # the restart record, or the launcher's in_job_restart record
    faults: list[dict[str, Any]]
    detected: float
    fired: list[tuple[float, str | None]]
    reentered: float
    restores: list[dict[str, Any]]
    # Every active rank's restore of the new iteration (``restores``: rank 0's alone).
    all_restores: list[dict[str, Any]] = field(default_factory=list)


def windows(
    rounds: list[dict[str, list[dict[str, Any]]]],
    in_job: list[dict[str, Any]],
    progress: list[tuple[float, int]],
    *,
    stepped: bool,
) -> list[Window]:
    """The fault windows of a launch, oldest first (one per in-process and in-job restart;
    restarts that start before the previous window closed merge into it: see
    ``inprocess.report.downtime``'s docstring). ``rounds``: the ranks' records by event, per
    round (``records.rounds``); ``in_job``: the launcher's "in_job_restart" records;
    ``progress``: rank 0's ``[(t, step)]``; ``stepped``: False when it has no step numbers."""
    out: list[Window] = []
    for c in _candidates(rounds, in_job):
        sign, fault = c.fired[0] if c.fired else (c.detected, None)
        before = [(t, s) for t, s in progress if t <= sign]
        last, reached = before[-1] if before else (sign, 0)
        restored = float(c.restores[0]["t"]) if c.restores else c.reentered
        first: Window | None = None  # an in-process window this restart extends
        if out and last < out[-1].back:  # a fault before the previous window closed: merge
            prev = out.pop()
            last, sign, reached, fault = prev.last, prev.sign, prev.reached_step, prev.fault
            if prev.level == IN_PROCESS and c.level == IN_PROCESS:
                first = prev
        restored_step = c.restores[0].get("step") if c.restores else None
        if stepped and restored_step is not None and int(restored_step) > reached:
            # The fault's first sign came from a rank ahead of rank 0 (a NaN on rank 1 before
            # rank 0 reached that step): rank 0 resumes at the restored step, nothing to redo.
            reached = int(restored_step)
        w = _window(c, progress, last=last, sign=sign, reached=reached, restored=restored)
        w.fault = fault  # the merged window keeps the first fault's
        out.append(w)
        if first is not None:
            # The window is the first fault's: its row names that fault, its iteration and
            # ranks, and its detection; the failed re-entry until the later restart is part of
            # ``restart`` (a kill, then a gloo timeout while the group re-formed under load).
            w.iteration, w.cause, w.kind = first.iteration, first.cause, first.kind
            w.faulting_ranks, w.training_ranks = first.faulting_ranks, first.training_ranks
            w.detected = first.detected
    return out


def _candidates(
    rounds: list[dict[str, list[dict[str, Any]]]], in_job: list[dict[str, Any]]
) -> list[_Candidate]:
    """Every restart of the launch in order: each round's in-process restarts, then the
    in-job restart that ended the round (if any)."""
    cands: list[_Candidate] = []
    for k, ev in enumerate(rounds):
        cands += _in_process(ev, k)
        if k + 1 < len(rounds):
            cand = _in_job(ev, rounds[k + 1], in_job, k)
            if cand is not None:
                cands.append(cand)
    return cands


def _window(
    c: _Candidate,
    progress: list[tuple[float, int]],
    *,
    last: float,
    sign: float,
    reached: int,
    restored: float,
) -> Window:
    """The window of restart ``c``, its fault's first sign at ``sign`` (rank 0 at step
    ``reached`` since ``last``): back once rank 0 passes ``reached`` again. ``fault`` is left
    None: the caller names it (the first fault's, when windows merge)."""
    restored_step = c.restores[0].get("step") if c.restores else None
    back_at = [t for t, s in progress if t > max(c.reentered, restored) and s >= reached]
    back = back_at[0] if back_at else restored
    resumed = next((t for t, _ in progress if t > c.reentered), None)
    in_job_level = c.level == IN_JOB
    return Window(
        iteration=c.iteration,
        cause=str(c.rec.get("reason" if in_job_level else "cause", "")),
        faulting_ranks=list(c.rec.get("faulting_ranks", []))
        if not in_job_level
        else sorted({int(r["fault_rank"]) for r in c.faults if "fault_rank" in r}),
        kind="in_job_restart" if in_job_level else _kind_from(c.rec),
        last=last,
        sign=sign,
        detected=c.detected,
        reentered=c.reentered,
        restored=restored,
        back=back,
        tier=c.restores[0].get("tier") if c.restores else None,
        restored_step=restored_step,
        reached_step=reached,
        fault=None,
        level=c.level,
        round=c.round,
        resumed=resumed,
        training_ranks=_training_ranks(c.rec, in_job_level),
        tiers=_tiers(c),
    )


def _tiers(c: _Candidate) -> str | None:
    """Each active rank's restored tier, grouped (the restart line's words), or None."""
    if not c.all_restores:
        return None
    newcomers = {int(r) for r in c.rec.get("active_after", [])} - {
        int(r) for r in c.rec.get("active_before", [])
    }
    by_rank = {int(r["rank"]): r.get("tier") for r in c.all_restores if "rank" in r}
    return phrase(by_rank, newcomers) or None


def _training_ranks(rec: dict[str, Any], in_job: bool) -> list[int | None]:
    """Where each blamed initial rank stood among the active ranks of the faulted iteration."""
    if in_job:
        return []
    before = [int(x) for x in rec.get("active_before", [])]
    return [before.index(r) if r in before else None for r in rec.get("faulting_ranks", [])]


def _fired_before(ev: dict[str, list[dict[str, Any]]], it: int, t: float) -> list[Any]:
    # A record without an iteration fired before its process entered the first one: the
    # config's drill, 0.3-0.6 s after the ranks met, which only processes of a job's start run
    # (seen on an H200 host, where iteration 0's health check first starts CUDA).
    return sorted(
        (float(r["t"]), r.get("fault"))
        for r in ev.get("fault_fired", [])
        if int(r.get("iteration", 0)) == it and float(r["t"]) <= t
    )


def _restores(ev: dict[str, list[dict[str, Any]]], it: int) -> list[dict[str, Any]]:
    return [
        r for r in ev.get("restore", []) if r.get("training_rank") == 0 and r.get("iteration") == it
    ]


def _in_process(ev: dict[str, list[dict[str, Any]]], k: int) -> list[_Candidate]:
    """The in-process restarts of one round, oldest first."""
    restarts: dict[int, dict[str, Any]] = {}
    for r in ev.get("restart", []):  # every rank logs it: keep the first of each iteration
        restarts.setdefault(int(r["iteration"]), r)
    out = []
    for new_it in sorted(restarts):
        rec = restarts[new_it]
        faulted = new_it - 1
        faults = [r for r in ev.get("fault", []) if int(r.get("iteration", -1)) == faulted]
        blamed = set(rec.get("faulting_ranks", []))
        own = [
            float(r["t"])
            for r in faults
            if r.get("fault_rank") in blamed and not r.get("in_collective")
        ]
        # Without the blamed rank's own record (a dead rank: its watchdog wrote to the store,
        # not to a journal), the earliest sign any rank left, or the restart's own estimate.
        detected = min(own) if own else min([float(r["t"]) for r in faults] + [_detected_from(rec)])
        reentered = min(
            (float(r["t"]) for r in ev.get("iteration_start", []) if int(r["iteration"]) == new_it),
            default=float(rec["t"]),
        )
        out.append(
            _Candidate(
                iteration=faulted,
                round=k,
                level=IN_PROCESS,
                rec=rec,
                faults=faults,
                detected=detected,
                fired=_fired_before(ev, faulted, detected),
                reentered=reentered,
                restores=_restores(ev, new_it),
                all_restores=[r for r in ev.get("restore", []) if r.get("iteration") == new_it],
            )
        )
    return out


def _in_job(
    ev: dict[str, list[dict[str, Any]]],
    nxt: dict[str, list[dict[str, Any]]],
    in_job: list[dict[str, Any]],
    k: int,
) -> _Candidate | None:
    """The in-job restart that ended round ``k`` (None when the next round never trained)."""
    recs = [r for r in in_job if int(r.get("round", k + 1)) == k + 1]
    starts = [float(r["t"]) for r in nxt.get("iteration_start", []) if int(r["iteration"]) == 0]
    if not recs or not starts:
        return None
    decided = min(float(r.get("decided", r["t"])) for r in recs)
    its = [int(r["iteration"]) for r in ev.get("iteration_start", [])]
    faulted = max(its, default=0)
    faults = [
        r
        for r in ev.get("fault", [])
        if int(r.get("iteration", -1)) == faulted and float(r["t"]) <= decided
    ]
    fired = _fired_before(ev, faulted, decided)
    if not fired and faults:  # the first sign is the first fault record of the iteration
        fired = [(min(float(r["t"]) for r in faults), None)]
    return _Candidate(
        iteration=faulted,
        round=k,
        level=IN_JOB,
        rec=min(recs, key=lambda r: float(r.get("decided", r["t"]))),
        faults=faults,
        detected=decided,
        fired=fired,
        reentered=min(starts),
        restores=_restores(nxt, 0),
    )


def _detected_from(restart: dict[str, Any]) -> float:
    """Without a fault record (a rank that died: its watchdog wrote to the store, not to a
    journal), the detection is when the restart began on the rank that logged it."""
    phases = restart.get("phases", {})
    return float(restart["t"]) - sum(float(v) for v in phases.values())


def _kind_from(restart: dict[str, Any]) -> str:
    """The blamed fault's kind, from the restart's cause (e.g. "dead on rank 1 (...)")."""
    cause = str(restart.get("cause", ""))
    return cause.split(" on rank", 1)[0] if " on rank" in cause else cause
