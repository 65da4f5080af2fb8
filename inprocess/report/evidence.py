"""The evidence of faults in journal records, one ``Fault`` per record that speaks of one.

``faults_of`` reads "fault" records, re-run verdicts that name a fault, and restarts whose blamed
rank left no record of its own (a killed process writes none); each is placed in its fault
window ``(launch, in-job round, iteration)`` and named by the planned fault that fired there.
``inprocess.report.attribution`` classifies them, one finding per window. Pure; no I/O.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Any

from restartable.inprocess.report.records import process_of

_RESTART_CAUSE = re.compile(r"^(?P<kind>[a-z_]+) on rank (?P<rank>\d+)")

Window = tuple[str, int, int]  # (launch, round, iteration)


@dataclass(frozen=True)
class Fault:
    """One piece of evidence about a fault, from a "fault", "rerun_verdict" or "restart" record.

    ``rank``: the initial rank (RANK at launch) of the blamed process; ``training_rank``: its rank
    among the ranks that trained in that iteration (what a fault plan and ``ctx.rank`` say).
    ``injected``: the name of the planned fault that fired on that process in that iteration.
    """

    launch: str
    iteration: int
    rank: int
    host: str
    kind: str
    exc_type: str
    where: str
    step: int | None
    detail: str
    in_collective: bool
    t: float
    round: int = 0
    training_rank: int | None = None
    injected: str = ""

    @property
    def signature(self) -> tuple[str, str, int | None]:
        return (self.exc_type or self.kind, self.where, self.step)

    @property
    def window(self) -> Window:
        return (self.launch, self.round, self.iteration)


def faults_of(records: list[dict[str, Any]]) -> list[Fault]:
    """The evidence in journal records: "fault" records, re-run verdicts that name a fault, and
    the restarts whose blamed rank left no record of its own (a killed process writes none)."""
    round_of = _rounds(records)
    host_of: dict[tuple[str, int], str] = {}
    for r in records:
        if isinstance(r.get("rank"), int) and r.get("host"):
            host_of.setdefault((str(r.get("launch", "")), int(r["rank"])), str(r["host"]))
    fired: dict[tuple[Window, int], tuple[str, int | None]] = {}
    for r in records:
        if r.get("event") == "fault_fired":
            key = ((str(r.get("launch", "")), round_of(r), int(r.get("iteration", 0))), r["rank"])
            fired.setdefault(key, (str(r.get("fault", r.get("kind", ""))), r.get("step")))
    out = [f for r in records if (f := _recorded(r, round_of, host_of)) is not None]
    out += _unrecorded(records, out, round_of, host_of)
    # Name the planned fault on the evidence of the process it fired on (and its step, where
    # the evidence has none: a killed process wrote nothing more).
    named = []
    for f in out:
        name, step = fired.get((f.window, f.rank), ("", None))
        named.append(replace(f, injected=name, step=step if f.step is None else f.step))
    return named


def _recorded(
    r: dict[str, Any], round_of: Any, host_of: dict[tuple[str, int], str]
) -> Fault | None:
    """The fault record ``r`` names: a "fault" record, or a re-run verdict that names a fault
    (None for any other record)."""
    event = r.get("event")
    launch = str(r.get("launch", ""))
    if event == "fault":
        rank = int(r.get("fault_rank", r.get("rank", -1)))
        own = rank == r.get("rank")
        return Fault(
            launch=launch,
            iteration=int(r.get("iteration", 0)),
            rank=rank,
            host=host_of.get((launch, rank), str(r.get("host", ""))),
            kind=str(r.get("kind", "")),
            exc_type=str(r.get("exc_type", "")),
            where=str(r.get("where", "")),
            step=r.get("step"),
            detail=str(r.get("detail", "")),
            in_collective=bool(r.get("in_collective", False)),
            t=float(r["t"]),
            round=round_of(r),
            training_rank=r.get("training_rank") if own else None,
        )
    if event == "rerun_verdict" and r.get("verdict") not in (None, "correct_result"):
        return Fault(
            launch=launch,
            iteration=int(r.get("iteration", 0)),
            rank=int(r.get("rank", -1)),
            host=str(r.get("host", "")),
            kind="rerun:" + str(r["verdict"]),
            exc_type="",
            where="",
            step=r.get("step"),
            detail=", ".join(map(str, r.get("suspect_hardware", []))),
            in_collective=False,
            t=float(r["t"]),
            round=round_of(r),
            training_rank=r.get("training_rank"),
        )
    if event == "sdc_finding":  # rerun.scrub: a checked step's result was wrong
        return _sdc_fault(r, launch, round_of(r))
    return None


def _sdc_fault(r: dict[str, Any], launch: str, round_: int) -> Fault:
    """The evidence of an ``sdc_finding`` record: the rank whose step was wrong, its host,
    the step, and in ``detail`` how it was settled and how far the job rolled back."""
    return Fault(
        launch=launch,
        iteration=int(r.get("iteration", 0)),
        rank=int(r.get("fault_rank", r.get("rank", -1))),
        host=str(r.get("host", "")),
        kind="sdc:" + str(r.get("verdict", "")),
        exc_type="",
        where="",
        step=r.get("step"),
        detail=(
            f"{r.get('verdict')} at step {r.get('step')} (found at step {r.get('detected_at')}), "
            f"settled by {r.get('settled_by')}; rolled back {r.get('steps_rolled_back')} step(s) "
            f"to step {r.get('rollback_to')}"
        ),
        in_collective=False,
        t=float(r["t"]),
        round=round_,
        training_rank=r.get("training_rank"),
    )


def _unrecorded(
    records: list[dict[str, Any]],
    seen: list[Fault],
    round_of: Any,
    host_of: dict[tuple[str, int], str],
) -> list[Fault]:
    """A restart that blames a rank with no record of its own in that window (a killed rank, a
    hard-timeout kill: the watchdog reports to the store, not to a journal): evidence from the
    restart's cause."""
    # Any record of the blamed rank in the window speaks for it: a collective failure the policy
    # counted as its own (no other rank's fault came first) stays a collective failure.
    own = {(f.window, f.rank) for f in seen}
    out: list[Fault] = []
    done: set[tuple[Window, int]] = set()
    for r in records:
        if r.get("event") != "restart":
            continue
        m = _RESTART_CAUSE.match(str(r.get("cause", "")))
        if m is None:
            continue
        launch = str(r.get("launch", ""))
        window = (launch, round_of(r), int(r["iteration"]) - 1)
        rank = int(m["rank"])
        if (window, rank) in own or (window, rank) in done:
            continue
        done.add((window, rank))
        before = [int(x) for x in r.get("active_before", [])]
        out.append(
            Fault(
                launch=launch,
                iteration=window[2],
                rank=rank,
                host=host_of.get((launch, rank), ""),
                kind=m["kind"],
                exc_type="",
                where="",
                step=None,
                detail=str(r.get("cause", "")),
                in_collective=False,
                t=float(r["t"]),
                round=window[1],
                training_rank=before.index(rank) if rank in before else None,
            )
        )
    return out


def _rounds(records: list[dict[str, Any]]) -> Any:
    """A function: a record -> the in-job restart round of its process (its launch's
    ``in_job_restart`` records that began before the process's first record)."""
    starts: dict[str, dict[int, float]] = defaultdict(dict)
    for r in records:
        if r.get("event") == "in_job_restart":
            launch, k = str(r.get("launch", "")), int(r.get("round", 0))
            starts[launch][k] = min(starts[launch].get(k, float(r["t"])), float(r["t"]))
    born: dict[Any, float] = {}
    for r in records:
        born.setdefault(process_of(r), float(r["t"]))

    def round_of(r: dict[str, Any]) -> int:
        first = born.get(process_of(r), float(r["t"]))
        return sum(t <= first for t in starts.get(str(r.get("launch", "")), {}).values())

    return round_of
