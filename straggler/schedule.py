"""When the next round is, pure: every rank meets at the same step without a collective per step.

Ranks agree on steps, not on clocks. Each round publishes the step of the next one, and whether
it is a report (gather every rank's times) or only a sync (one compare-and-set, no waiting)
that refines the estimate of seconds per step. The gap between syncs doubles from one step
until the next report's step can be estimated, so a job finds its rhythm in a few syncs and
then talks to the store only once per report; each report re-estimates, so a job whose steps
become slower or faster keeps reporting about every ``report_time_interval`` seconds.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Plan:
    """The next round: at ``step``; a report when ``report``, else a sync. ``gap``: the step
    distance the doubling of syncs has reached."""

    step: int
    report: bool
    gap: int

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls(**json.loads(text))


def first_plan(step: int) -> Plan:
    """The plan made at the first call (nothing measured yet): a sync one step later."""
    return Plan(step=step + 1, report=False, gap=1)


def next_plan(
    *,
    step: int,
    gap: int,
    seconds_per_step: float,
    since_report: float,
    interval: float,
) -> Plan:
    """The round after the one at ``step``.

    ``seconds_per_step``: measured since the previous round; ``since_report``: seconds since the
    last report (or since the first call); ``gap``: the previous plan's. A report is planned as
    soon as its step is within twice the current gap, else a sync at twice the gap.
    """
    left = max(0.0, interval - since_report)
    needed = max(1, math.ceil(left / seconds_per_step)) if seconds_per_step > 0 else 1
    if needed <= 2 * gap:
        return Plan(step=step + needed, report=True, gap=max(gap, needed))
    return Plan(step=step + 2 * gap, report=False, gap=2 * gap)
