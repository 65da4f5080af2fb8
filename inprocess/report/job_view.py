"""The job view over attempts: one job's launches (Slurm requeues, relaunches) end to end (pure).

A requeued or relaunched job journals each attempt under its own launch id; ``inprocess.report``
makes one report per attempt (``inprocess.report.downtime``) and, when a directory holds several,
this view over them, oldest first:

    wall          = the last attempt's end - the first attempt's start
    requeue gap   = the next attempt's start - an attempt's end (the job was not running: queued,
                    scheduled, starting processes), a kind of downtime of its own
    requeue redo  = in an attempt after the first, the time from its first step until it
                    reached again the highest step of the attempt before (work the earlier
                    attempt did but did not checkpoint, done again; zero without step numbers)
    startup       = the attempts' startups
    downtime      = the attempts' downtime + requeue gaps + requeue redo
    productive    = wall - startup - downtime   (the attempts' productive less the redo)

so ``wall = startup + productive + downtime`` holds for the job as for each attempt.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from restartable.inprocess.report.terms import LaunchReport


@dataclass(frozen=True)
class Gap:
    """The time between two attempts, and the redo it caused in the later one (seconds)."""

    after: str  # the launch id of the attempt that ended
    before: str  # the launch id of the attempt that began
    gap: float
    redo: float
    redo_to_step: int | None  # the step the later attempt had to reach again (None: no steps)


@dataclass
class JobView:
    """The attempts of one job and the requeue gaps between them."""

    attempts: list[LaunchReport]
    gaps: list[Gap] = field(default_factory=list)

    @property
    def wall(self) -> float:
        return self.attempts[-1].end - self.attempts[0].start

    @property
    def startup(self) -> float:
        return sum(a.startup for a in self.attempts)

    @property
    def requeue_downtime(self) -> float:
        return sum(g.gap + g.redo for g in self.gaps)

    @property
    def downtime(self) -> float:
        return sum(a.downtime for a in self.attempts) + self.requeue_downtime

    @property
    def productive(self) -> float:
        return self.wall - self.startup - self.downtime

    @property
    def goodput(self) -> float:
        return self.productive / self.wall if self.wall > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "attempts": [a.launch for a in self.attempts],
            "wall_s": self.wall,
            "startup_s": self.startup,
            "productive_s": self.productive,
            "downtime_s": self.downtime,
            "requeue_downtime_s": self.requeue_downtime,
            "goodput": self.goodput,
            "gaps": [
                {
                    "after": g.after,
                    "before": g.before,
                    "gap_s": g.gap,
                    "redo_s": g.redo,
                    "redo_to_step": g.redo_to_step,
                }
                for g in self.gaps
            ],
        }


def build(attempts: list[LaunchReport]) -> JobView:
    """The view over ``attempts`` (sorted here by start). An attempt that overlaps the one before
    (two launches at once: not a requeue) gets a zero gap."""
    ordered = sorted(attempts, key=lambda a: a.start)
    if not ordered:
        raise ValueError("a job view needs at least one attempt")
    gaps = []
    for prev, nxt in itertools.pairwise(ordered):
        gaps.append(
            Gap(
                after=prev.launch,
                before=nxt.launch,
                gap=max(0.0, nxt.start - prev.end),
                redo=_redo(prev, nxt),
                redo_to_step=prev.steps if nxt.progress_source != "probe" else None,
            )
        )
    return JobView(ordered, gaps)


def _redo(prev: LaunchReport, nxt: LaunchReport) -> float:
    """Time ``nxt`` spent before it reached ``prev``'s highest step again (outside its own fault
    windows' redo: a window closes at a step it had reached itself)."""
    if prev.steps is None or nxt.steps is None or not nxt.progress or not prev.progress:
        return 0.0
    if prev.progress_source != nxt.progress_source:
        return 0.0  # steps of different sources are not comparable
    first_t, first_step = nxt.progress[0]
    if first_step >= prev.steps:
        return 0.0
    back = next((t for t, s in nxt.progress if s >= prev.steps), nxt.end)
    windows = sum(
        max(0.0, min(w.back, back) - max(w.last, first_t)) for w in nxt.windows if w.last < back
    )
    return max(0.0, back - first_t - windows)


def format_view(view: JobView) -> str:
    """The job view as text: totals, then one row per attempt and per gap between them."""
    lines = [
        f"job over {len(view.attempts)} attempts: wall {view.wall:.2f} s = startup "
        f"{view.startup:.2f} s + productive {view.productive:.2f} s + downtime "
        f"{view.downtime:.2f} s (of which requeue {view.requeue_downtime:.2f} s); goodput "
        f"{100 * view.goodput:.1f} %",
        f"  {'attempt':28} {'wall [s]':>9} {'startup [s]':>11} {'productive [s]':>14} "
        f"{'downtime [s]':>12} {'steps':>7}",
    ]
    for i, a in enumerate(view.attempts):
        steps = "-" if a.steps is None else str(a.steps)
        lines.append(
            f"  {i:2d} {a.launch or '-':25} {a.wall:9.2f} {a.startup:11.2f} {a.productive:14.2f} "
            f"{a.downtime:12.2f} {steps:>7}"
        )
        if i < len(view.gaps):
            g = view.gaps[i]
            to = "" if g.redo_to_step is None else f" (back to step {g.redo_to_step})"
            lines.append(
                f"     requeue gap {g.gap:9.2f} s between attempts; requeue redo {g.redo:.2f} s{to}"
            )
    lines.append(
        "  (requeue gap: one attempt ended -> the next started; requeue redo: the next attempt's "
        "first step -> the step the one before had reached; both are downtime)"
    )
    return "\n".join(lines)
