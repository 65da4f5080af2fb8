"""Performance scores, pure: from per-rank section times to relative and individual scores,
stragglers, consecutive-report streaks and the one rank to demote. No I/O, no clock, no state.

A score is ``reference time / own time``, capped at 1.0: 1.0 is as fast as the reference, 0.5 is
twice as slow. A rank's score over several sections is their mean weighted by the reference
time of each section, so a long section counts for more than a short one.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

# Which time of a report's samples stands for a section: the lower quartile, not the median.
# A slow device or a throttled core is slow at every step, which moves every quantile alike;
# interference from other processes (a shared host, its caches) inflates some steps only. On
# our shared 2-core machine the median let such bursts read as 1.4x-2x slowdowns: false
# reports in 3 of 36 clean runs at 0.5 s report intervals (docs/straggler.md).
QUANTILE = 0.25


def section_times(
    samples: Mapping[str, Sequence[float]], *, quantile: float = QUANTILE
) -> dict[str, float]:
    """The ``quantile`` time of each section that has samples (seconds; lower value)."""
    out = {}
    for name, values in samples.items():
        if values:
            ordered = sorted(values)
            out[name] = ordered[int(quantile * (len(ordered) - 1))]
    return out


def _score(reference: float, own: float) -> float:
    if own <= 0.0:  # no measurable time: nothing to be slow at
        return 1.0
    return min(1.0, reference / own)


def _weighted(scores: Mapping[str, float], weights: Mapping[str, float]) -> float:
    total = sum(weights[s] for s in scores)
    if total <= 0.0:
        return min(scores.values()) if scores else 1.0
    return sum(scores[s] * weights[s] for s in scores) / total


def relative_scores(
    times: Mapping[int, Mapping[str, float]], *, reference: str = "median"
) -> tuple[dict[int, float], dict[str, dict[int, float]]]:
    """Each rank's time against the reference rank's, per section and overall.

    ``times``: {rank: {section: seconds}} of one report (``section_times``). Only sections
    every rank timed are compared (a section one rank never ran says nothing about its speed).
    ``reference``: "median" (the lower median of the ranks' times: with two ranks the faster
    one, with more a typical one, so a single fast rank cannot make everyone a straggler) or
    "best" (the fastest rank). Returns ({rank: score}, {section: {rank: score}}).
    """
    if not times:
        return {}, {}
    common = set.intersection(*(set(m) for m in times.values()))
    refs: dict[str, float] = {}
    per_section: dict[str, dict[int, float]] = {}
    for name in sorted(common):
        ranks_times = [m[name] for m in times.values()]
        refs[name] = (
            statistics.median_low(ranks_times) if reference == "median" else min(ranks_times)
        )
        per_section[name] = {r: _score(refs[name], m[name]) for r, m in times.items()}
    overall = {
        r: _weighted({s: per_section[s][r] for s in per_section}, refs) if per_section else 1.0
        for r in times
    }
    return overall, per_section


def individual_score(
    current: Mapping[str, float], history: Sequence[Mapping[str, float]]
) -> tuple[float, dict[str, float]]:
    """This rank's time against its own recent history (its last reports' section times).

    The reference of a section is the lower median of its past times: the rank's typical
    recent speed. Not their minimum: measured on a shared 2-core machine, one lucky quiet
    interval made the minimum low enough that ordinary noise later read as a 1.4x slowdown;
    the lower median needs half the window to be that fast. A
    section without history scores 1.0 (nothing to compare with yet). The history is a window
    the caller keeps short, so the baseline follows a lasting change (a new kernel, a larger
    batch) within half a window instead of flagging it forever. Returns (overall, {section:
    score}).
    """
    past_times: dict[str, list[float]] = {}
    for past in history:
        for name, t in past.items():
            past_times.setdefault(name, []).append(t)
    best = {name: statistics.median_low(times) for name, times in past_times.items()}
    per_section = {
        name: _score(best[name], t) if name in best else 1.0 for name, t in current.items()
    }
    weights = {name: best.get(name, t) for name, t in current.items()}
    return (_weighted(per_section, weights) if per_section else 1.0), per_section


def beyond_job_trend(individual: Mapping[int, float]) -> tuple[dict[int, float], float]:
    """Each rank's individual score relative to the job's, and the job's (its upper median).

    A job-wide slowdown (the host under load, a slower phase of the model) lowers every rank's
    individual score alike; no rank holds the others back, and no swap would help. Measured:
    in 1 of 20 clean runs on our shared 2-core machine both ranks' individual scores fell to
    0.66 and 0.75 together. Dividing by the job's score keeps what is this rank's own. The
    upper median: with two ranks the better one, so a single slowing rank still stands out.
    One rank alone has no job to compare with: its score is returned as it is.
    """
    if len(individual) < 2:
        return dict(individual), 1.0
    trend = statistics.median_high(individual.values())
    if trend <= 0.0:
        return {r: 1.0 for r in individual}, trend
    return {r: min(1.0, s / trend) for r, s in individual.items()}, trend


def find_stragglers(
    relative: Mapping[int, float],
    individual: Mapping[int, float],
    *,
    relative_threshold: float,
    individual_threshold: float,
) -> dict[int, tuple[str, ...]]:
    """Ranks with a score below its threshold, with the reasons (``"relative 0.48"``)."""
    found: dict[int, list[str]] = {}
    for family, scores, threshold in (
        ("relative", relative, relative_threshold),
        ("individual", individual, individual_threshold),
    ):
        for rank, score in scores.items():
            if score < threshold:
                found.setdefault(rank, []).append(f"{family} {score:.2f}")
    return {rank: tuple(why) for rank, why in sorted(found.items())}


def update_streaks(previous: Mapping[int, int], flagged: Sequence[int]) -> dict[int, int]:
    """Consecutive reports each rank was flagged in, after one more report.

    A rank not flagged in this report (or missing from it) starts again from zero.
    """
    return {rank: previous.get(rank, 0) + 1 for rank in sorted(flagged)}


def pick_demotion(
    streaks: Mapping[int, int],
    scores: Mapping[int, float],
    *,
    after: int,
) -> tuple[int | None, tuple[int, ...]]:
    """The one rank to demote after this report, and the confirmed ones left for later.

    Confirmed: flagged in ``after`` consecutive reports. At most one per report, because each
    demotion costs a restart and a reserve: the lowest score goes first (ties: lowest rank),
    the others stay confirmed and come next time if they are still slow.
    """
    confirmed = sorted(
        (r for r, n in streaks.items() if n >= after), key=lambda r: (scores.get(r, 1.0), r)
    )
    if not confirmed:
        return None, ()
    return confirmed[0], tuple(confirmed[1:])


def min_scores(*families: Mapping[int, float]) -> dict[int, float]:
    """Each rank's lowest score over the given score families."""
    out: dict[int, float] = {}
    for scores in families:
        for rank, score in scores.items():
            out[rank] = min(score, out.get(rank, score))
    return out
