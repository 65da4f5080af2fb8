"""Downtime terms of one launch, computed from its journal records (pure; no I/O).

Definitions (all times are the journal's ``time.time()`` stamps, seconds). Progress is what
the framework saw of training rank 0, from the first source that has any (``progress_source``):

    ping       its ``step`` records: ``step`` s at time t means rank 0 reached step s (it called
               ``ctx.ping(s)``), so step s - 1 was complete
    saves      its checkpoint ``save`` records (a script that never calls ``ctx.ping``): step s
               at t means s was saved, so the steps between two saves are one unit of progress
    probe      its ``progress`` records (the soft timeout's progress probe saw its main thread
               run, at most one a second, written only while no step is known): no step
               numbers; the windows' redo is zero and ``steps`` is None

    wall       = job_end - job_start (the launch's first "job_start", last "job_end")
    startup    = first step reached - job_start
    per fault window (one per in-process restart, and one per in-job restart of
    ``inprocess.launch``; a restart that starts before the previous window closed extends it,
    and an in-process window so extended keeps the first fault's iteration, cause, ranks and
    detection: the failed re-entry is part of its ``restart``):
      last     = the last step reached before the fault's first sign
      sign     = the injected fault's "fault_fired" stamp, else the first "fault" record
      fault    = the name of that injected fault (e.g. "hang@rank0:step150"), else None
      detected = in-process: the blamed rank's own "fault" record; without one (a dead rank),
                 the first "fault" record of the iteration or the restart record's estimate.
                 in-job: when the launcher saw the decision to restart every rank
                 ("in_job_restart"'s ``decided``)
      reentered= the first "iteration_start" of the next iteration (in-job: of the new round)
      restored = the "restore" record of rank 0 in that iteration (so ``reload`` holds the
                 set-up of the new iteration too: model, DDP, a joining reserve's first steps)
      back     = the first time after ``restored`` that rank 0 reaches again the step it had
                 reached at ``last`` (probe: its first sign of progress after ``restored``)
      terms    : lost_before = sign - last, detection = detected - sign,
                 restart = reentered - detected, reload = restored - reentered,
                 redo = back - restored;  downtime = back - last (their sum)
      recovery = rank 0's first step after ``reentered`` - detected (reported, not summed)
    checkpoint = the save stalls of rank 0 outside fault windows
    downtime   = checkpoint + sum of the windows' downtime
    productive = wall - startup - downtime                 (so the three add up to wall)
    goodput    = productive / wall

Rounds: an in-job restart starts new processes whose iterations count from 0 again; a process
belongs to round n when n "in_job_restart" rounds began before its first record.

Respawns (the launcher's "respawn" records) are windows of their own, outside the downtime sum:
the ranks that train go on meanwhile (the in-process window of the same death, if the process
was active, holds the training's downtime), but the reserve pool is short by one:
      sign     = the dead process's own "fault_fired" of a process-ending kind (an injected
                 kill or GIL-held hang), else the first "fault" record that blames it written
                 after its last record, else ``detected``
      detected = the launcher saw the process exit ("respawn")
      spawned  = the launcher started the new process ("respawn_started")
      ready    = the new process registered as a reserve ("reserve_ready")
      terms    : detection = detected - sign, start = spawned - detected (backoff included),
                 join = ready - spawned;  recovery = ready - detected

The report's parts: ``terms`` (the report and its windows), ``records`` (the records grouped),
``fault_windows`` and ``respawn_windows`` (the windows); this module assembles them (``build``).
"""

from __future__ import annotations

from typing import Any

from restartable.inprocess.report.fault_windows import windows as fault_windows
from restartable.inprocess.report.records import by_event
from restartable.inprocess.report.records import rounds as round_records
from restartable.inprocess.report.respawn_windows import respawn_windows
from restartable.inprocess.report.terms import LaunchReport


def launches(records: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Records grouped by launch id (records without one form the launch "")."""
    out: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        out.setdefault(str(r.get("launch", "")), []).append(r)
    return out


def build(records: list[dict[str, Any]], launch: str = "") -> LaunchReport:
    """The report of one launch's records (sorted by time, as ``journal.read`` returns them).

    Raises ``ValueError`` when the records hold no sign of training rank 0's progress at all (a
    journal of a job that never trained).
    """
    ev = by_event(records)
    progress, source = progress_of(ev)
    if not progress:
        raise ValueError(
            "no progress of training rank 0 in the journal (no step, checkpoint save or "
            "progress probe record): the job never trained with the journal on; once it does, "
            "ctx.ping(step) at each step gives the report step numbers (optional)"
        )
    start = min(float(r["t"]) for r in ev.get("job_start", records[:1]))
    ends = ev.get("job_end") or records[-1:]
    end = max(float(r["t"]) for r in ends)
    rounds = round_records(records)
    windows = fault_windows(
        rounds, ev.get("in_job_restart", []), progress, stepped=source != "probe"
    )
    stalls = [
        (float(r["t"]), float(r.get("stall_s", 0.0)))
        for r in ev.get("save", [])
        if r.get("training_rank", r.get("rank")) == 0
    ]
    checkpoint = sum(s for t, s in stalls if not any(w.last <= t <= w.back for w in windows))
    return LaunchReport(
        launch=launch,
        start=start,
        end=end,
        startup=progress[0][0] - start,
        checkpoint=checkpoint,
        windows=windows,
        restarts=sum(
            len({int(r["iteration"]) for r in ev_r.get("restart", [])}) for ev_r in rounds
        ),
        respawns=len(ev.get("respawn", [])),
        in_job_restarts=len({int(r.get("round", 0)) for r in ev.get("in_job_restart", [])}),
        steps=None if source == "probe" else max(s for _, s in progress),
        respawn_windows=respawn_windows(records, ev, rounds),
        progress_source=source,
        progress=progress,
    )


def progress_of(ev: dict[str, list[dict[str, Any]]]) -> tuple[list[tuple[float, int]], str]:
    """Training rank 0's progress ``[(t, step)]`` and its source (see the module docstring);
    the probe's points all carry step 0."""
    for event, source in (("step", "ping"), ("save", "saves"), ("progress", "probe")):
        points = [
            (float(r["t"]), int(r.get("step", 0)))
            for r in ev.get(event, [])
            if r.get("training_rank") == 0
        ]
        if points:
            return points, source
    return [], "ping"
