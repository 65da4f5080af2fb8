"""Downtime terms of one launch, computed from its journal records (pure; no I/O).

Definitions (all times are the journal's ``time.time()`` stamps, seconds). Progress is the
training rank 0's ``step`` records: ``step`` s at time t means rank 0 reached step s (it
called ``ctx.ping(s)``), so step s - 1 was complete.

    wall       = job_end - job_start (the launch's first "job_start", last "job_end")
    startup    = first step reached - job_start
    per fault window (one per in-process restart; a restart that starts before the previous
    window closed extends it):
      last     = the last step reached before the fault's first sign
      sign     = the injected fault's "fault_fired" stamp, else the first "fault" record
      fault    = the name of that injected fault (e.g. "hang@rank0:step150"), else None
      detected = the blamed rank's own "fault" record; without one (a dead rank), the first
                 "fault" record of the iteration or the restart record's estimate
      reentered= the first "iteration_start" of the next iteration
      restored = the "restore" record of rank 0 in that iteration (so ``reload`` holds the
                 set-up of the new iteration too: model, DDP, a joining reserve's first steps)
      back     = the first time rank 0 reaches again the step it had reached at ``last``
      terms    : lost_before = sign - last, detection = detected - sign,
                 restart = reentered - detected, reload = restored - reentered,
                 redo = back - restored;  downtime = back - last (their sum)
    checkpoint = the save stalls of rank 0 outside fault windows
    downtime   = checkpoint + sum of the windows' downtime
    productive = wall - startup - downtime                 (so the three add up to wall)
    goodput    = productive / wall
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Window:
    """One fault's downtime window and its terms (seconds)."""

    iteration: int  # the iteration that faulted
    cause: str
    faulting_ranks: list[int]
    kind: str
    last: float
    sign: float
    detected: float
    reentered: float
    restored: float
    back: float
    tier: str | None
    restored_step: int | None
    reached_step: int
    fault: str | None = None  # the injected fault whose "fault_fired" record is ``sign``

    @property
    def terms(self) -> dict[str, float]:
        return {
            "lost_before": self.sign - self.last,
            "detection": self.detected - self.sign,
            "restart": self.reentered - self.detected,
            "reload": self.restored - self.reentered,
            "redo": self.back - self.restored,
            "downtime": self.back - self.last,
        }


@dataclass
class LaunchReport:
    """The terms of one launch; ``wall == startup + productive + downtime`` by construction."""

    launch: str
    start: float
    end: float
    startup: float
    checkpoint: float
    windows: list[Window] = field(default_factory=list)
    restarts: int = 0
    steps: int = 0  # the highest step rank 0 reached (``ctx.ping``): steps - 1 were complete
    respawns: int = 0  # processes the launcher started again (its journal, when it keeps one)
    in_job_restarts: int = 0

    @property
    def wall(self) -> float:
        return self.end - self.start

    @property
    def downtime(self) -> float:
        return self.checkpoint + sum(w.terms["downtime"] for w in self.windows)

    @property
    def productive(self) -> float:
        return self.wall - self.startup - self.downtime

    @property
    def goodput(self) -> float:
        return self.productive / self.wall if self.wall > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "launch": self.launch,
            "wall_s": self.wall,
            "startup_s": self.startup,
            "productive_s": self.productive,
            "downtime_s": self.downtime,
            "checkpoint_s": self.checkpoint,
            "goodput": self.goodput,
            "restarts": self.restarts,
            "respawns": self.respawns,
            "in_job_restarts": self.in_job_restarts,
            "steps": self.steps,
            "faults": [
                {
                    **{k: v for k, v in asdict(w).items()},
                    **{f"{k}_s": v for k, v in w.terms.items()},
                }
                for w in self.windows
            ],
        }


def launches(records: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Records grouped by launch id (records without one form the launch "")."""
    out: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        out.setdefault(str(r.get("launch", "")), []).append(r)
    return out


def build(records: list[dict[str, Any]], launch: str = "") -> LaunchReport:
    """The report of one launch's records (sorted by time, as ``journal.read`` returns them).

    Raises ``ValueError`` when the records hold no step of training rank 0 (a journal of a job
    that never trained, or a script that never calls ``ctx.ping(step)``).
    """
    ev = _by_event(records)
    progress = [
        (float(r["t"]), int(r["step"])) for r in ev.get("step", []) if r.get("training_rank") == 0
    ]
    if not progress:
        raise ValueError(
            "no step of training rank 0 in the journal: call ctx.ping(step) at each step "
            "(the report measures progress from it)"
        )
    start = min(float(r["t"]) for r in ev.get("job_start", records[:1]))
    ends = ev.get("job_end") or records[-1:]
    end = max(float(r["t"]) for r in ends)
    windows = _windows(ev, progress)
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
        restarts=len({int(r["iteration"]) for r in ev.get("restart", [])}),
        respawns=len(ev.get("respawn", [])),
        in_job_restarts=len(ev.get("in_job_restart", [])),
        steps=max(s for _, s in progress),
    )


def _by_event(records: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    ev: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        ev.setdefault(str(r["event"]), []).append(r)
    return ev


def _windows(
    ev: dict[str, list[dict[str, Any]]], progress: list[tuple[float, int]]
) -> list[Window]:
    restarts: dict[int, dict[str, Any]] = {}
    for r in ev.get("restart", []):  # every rank logs it: keep the first of each iteration
        restarts.setdefault(int(r["iteration"]), r)
    out: list[Window] = []
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
        fired = sorted(
            (
                (float(r["t"]), r.get("fault"))
                for r in ev.get("fault_fired", [])
                if int(r.get("iteration", -1)) == faulted and float(r["t"]) <= detected
            ),
            key=lambda f: f[0],
        )
        sign, fault = fired[0] if fired else (detected, None)
        before = [(t, s) for t, s in progress if t <= sign]
        last, reached = before[-1] if before else (sign, 0)
        reentered = min(
            (float(r["t"]) for r in ev.get("iteration_start", []) if int(r["iteration"]) == new_it),
            default=float(rec["t"]),
        )
        restores = [
            r
            for r in ev.get("restore", [])
            if r.get("training_rank") == 0 and r.get("iteration") == new_it
        ]
        restored = float(restores[0]["t"]) if restores else reentered
        if out and last < out[-1].back:  # a fault before the previous window closed: merge
            prev = out.pop()
            last, sign, reached, fault = prev.last, prev.sign, prev.reached_step, prev.fault
        back_at = [t for t, s in progress if t > reentered and s >= reached]
        back = back_at[0] if back_at else restored
        out.append(
            Window(
                iteration=faulted,
                cause=str(rec.get("cause", "")),
                faulting_ranks=list(rec.get("faulting_ranks", [])),
                kind=_kind_from(rec),
                last=last,
                sign=sign,
                detected=detected,
                reentered=reentered,
                restored=restored,
                back=back,
                tier=restores[0].get("tier") if restores else None,
                restored_step=restores[0].get("step") if restores else None,
                reached_step=reached,
                fault=fault,
            )
        )
    return out


def _detected_from(restart: dict[str, Any]) -> float:
    """Without a fault record (a rank that died: its watchdog wrote to the store, not to a
    journal), the detection is when the restart began on the rank that logged it."""
    phases = restart.get("phases", {})
    return float(restart["t"]) - sum(float(v) for v in phases.values())


def _kind_from(restart: dict[str, Any]) -> str:
    """The blamed fault's kind, from the restart's cause (e.g. "dead on rank 1 (...)")."""
    cause = str(restart.get("cause", ""))
    return cause.split(" on rank", 1)[0] if " on rank" in cause else cause
