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
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from inprocess.restart.restored import phrase

IN_PROCESS = "in-process"
IN_JOB = "in-job"
# Injected faults (inprocess.faults, inprocess.faults.drill) after which the process is gone: the
# first sign of a respawn's death. A process may die between its own record and the signal,
# but never write another record after it, so its last one of these is the one.
_PROCESS_ENDING = frozenset({"kill", "hang_gil", "rank_killed", "rank_hung"})


@dataclass
class Window:
    """One fault's downtime window and its terms (seconds)."""

    iteration: int  # the iteration that faulted (of its round)
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
    level: str = IN_PROCESS  # or IN_JOB: inprocess.launch restarted every rank
    round: int = 0  # the in-job restart round the fault happened in
    resumed: float | None = None  # rank 0's first step after ``reentered``
    # The blamed ranks' training ranks in the faulted iteration (what a fault plan and
    # ``ctx.rank`` call them), in the order of ``faulting_ranks``; None where unknown.
    training_ranks: list[int | None] = field(default_factory=list)
    # The tier each active rank restored from, e.g. "memory on 1 rank, node-local on 1 rank (the
    # reserve)" (``inprocess.restart.restored.phrase``); None without the ranks' restores.
    tiers: str | None = None

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

    @property
    def recovery(self) -> float | None:
        """Detection to rank 0's first step after it (None without a step)."""
        return None if self.resumed is None else self.resumed - self.detected


@dataclass
class RespawnWindow:
    """A process the launcher replaced: from its death until the new one is a ready reserve."""

    slot_rank: int  # the slot's RANK
    identity: int  # the dead process's identity (``inprocess.protocol.ranks.respawn_identity``)
    how: str  # e.g. "was killed by SIGKILL"
    sign: float
    detected: float
    spawned: float | None  # None: not started (the job ended first)
    ready: float | None  # None: it never registered (died at start-up, or the job ended)
    new_identity: int | None = None
    fault: str | None = None  # the injected fault that killed it

    @property
    def terms(self) -> dict[str, float | None]:
        spawned, ready = self.spawned, self.ready
        return {
            "detection": self.detected - self.sign,
            "start": None if spawned is None else spawned - self.detected,
            "join": None if spawned is None or ready is None else ready - spawned,
            "recovery": None if ready is None else ready - self.detected,
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
    steps: int | None = 0  # the highest step rank 0 reached (None: no step known, see below)
    respawns: int = 0  # processes the launcher started again (its journal, when it keeps one)
    in_job_restarts: int = 0
    respawn_windows: list[RespawnWindow] = field(default_factory=list)
    progress_source: str = "ping"  # "ping" | "saves" | "probe" (see the module docstring)
    progress: list[tuple[float, int]] = field(default_factory=list, repr=False)

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
            "progress_source": self.progress_source,
            "faults": [
                {
                    **asdict(w),
                    **{f"{k}_s": v for k, v in w.terms.items()},
                    "recovery_s": w.recovery,
                }
                for w in self.windows
            ],
            "respawn_windows": [
                {**asdict(w), **{f"{k}_s": v for k, v in w.terms.items()}}
                for w in self.respawn_windows
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

    Raises ``ValueError`` when the records hold no sign of training rank 0's progress at all (a
    journal of a job that never trained).
    """
    ev = _by_event(records)
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
    rounds = _rounds(records)
    windows = _windows(rounds, ev.get("in_job_restart", []), progress, stepped=source != "probe")
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
        respawn_windows=_respawn_windows(records, ev, rounds),
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


def _by_event(records: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    ev: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        ev.setdefault(str(r["event"]), []).append(r)
    return ev


def _process(r: dict[str, Any]) -> tuple[Any, ...]:
    # journal.read names each record's file (one per process); synthetic records may not.
    return (r["_file"],) if "_file" in r else (r.get("host"), r.get("pid"), r.get("rank"))


def _round_starts(records: list[dict[str, Any]]) -> list[float]:
    """When each in-job restart round began (the first launcher to record it), in order."""
    first: dict[int, float] = {}
    for r in records:
        if r["event"] == "in_job_restart":
            k = int(r.get("round", len(first) + 1))
            first[k] = min(first.get(k, float(r["t"])), float(r["t"]))
    return [first[k] for k in sorted(first)]


def _rounds(records: list[dict[str, Any]]) -> list[dict[str, list[dict[str, Any]]]]:
    """The ranks' records by event, one map per round (a process's round: the number of
    in-job restart rounds that began before its first record). Launcher records (rank < 0)
    are left out."""
    starts = _round_starts(records)
    born: dict[tuple[Any, ...], float] = {}
    for r in records:
        born.setdefault(_process(r), float(r["t"]))
    out: list[dict[str, list[dict[str, Any]]]] = [{} for _ in range(len(starts) + 1)]
    for r in records:
        if isinstance(r.get("rank"), int) and r["rank"] < 0:
            continue
        k = sum(t <= born[_process(r)] for t in starts)
        out[k].setdefault(str(r["event"]), []).append(r)
    return out


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


def _windows(
    rounds: list[dict[str, list[dict[str, Any]]]],
    in_job: list[dict[str, Any]],
    progress: list[tuple[float, int]],
    *,
    stepped: bool,
) -> list[Window]:
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


def _respawn_windows(
    records: list[dict[str, Any]],
    ev: dict[str, list[dict[str, Any]]],
    rounds: list[dict[str, list[dict[str, Any]]]],
) -> list[RespawnWindow]:
    starts = _round_starts(records)
    last_of: dict[Any, float] = {}  # each rank process's last record
    killed_by: dict[Any, dict[str, Any]] = {}  # its last injected fault that ends a process
    for r in records:
        if r.get("pid") is None or (isinstance(r.get("rank"), int) and r["rank"] < 0):
            continue
        last_of[(r.get("host"), r["pid"])] = float(r["t"])
        if r["event"] == "fault_fired" and r.get("kind") in _PROCESS_ENDING:
            killed_by[(r.get("host"), r["pid"])] = r
    out = []
    for rec in ev.get("respawn", []):
        detected, identity = float(rec["t"]), int(rec["identity"])
        k = sum(t <= detected for t in starts)
        proc = (rec.get("host"), rec.get("proc_pid"))
        fired = killed_by.get(proc)
        if fired is not None and float(fired["t"]) <= detected:
            sign, fault = float(fired["t"]), fired.get("fault")
        else:  # a fault record that blames it, written after its own last record
            after = last_of.get(proc, float("-inf"))
            blamed = [
                float(r["t"])
                for r in rounds[k].get("fault", [])
                if r.get("fault_rank") == identity and after <= float(r["t"]) <= detected
            ]
            sign, fault = min(blamed, default=detected), None
        started = [
            r
            for r in ev.get("respawn_started", [])
            if r.get("replaces") == identity and float(r["t"]) >= detected
        ]
        spawned = float(started[0]["t"]) if started else None
        new = int(started[0]["identity"]) if started else None
        ready = next(
            (
                float(r["t"])
                for r in ev.get("reserve_ready", [])
                if new is not None and int(r["identity"]) == new
            ),
            None,
        )
        out.append(
            RespawnWindow(
                slot_rank=int(rec.get("slot_rank", identity)),
                identity=identity,
                how=str(rec.get("how", "")),
                sign=sign,
                detected=detected,
                spawned=spawned,
                ready=ready,
                new_identity=new,
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
