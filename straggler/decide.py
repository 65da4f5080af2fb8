"""A report round's numbers: what each rank sends (``rank_numbers``) and the report the
publishing rank decides from every rank's numbers (``decide``).

``Detector`` calls ``rank_numbers`` on every rank at a report round, and ``decide`` on whichever
rank publishes first (``StoreRounds.report``), on the training thread. Pure but for the one
``clock`` read that times the round; never blocks.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from restartable.inprocess.clock import Clock
from restartable.straggler import scores
from restartable.straggler.config import DetectorConfig
from restartable.straggler.report import Report

# {section: {rank: score}}, per family
SectionScores = dict[str, dict[int, float]]


def rank_numbers(
    host: str, times: dict[str, float], individual: float, section_individual: dict[str, float]
) -> str:
    """This rank's numbers for the round, as the JSON text the store carries."""
    return json.dumps(
        {
            "host": host,
            "times": times,
            "individual": individual,
            "section_individual": section_individual,
        }
    )


def decide(
    cfg: DetectorConfig,
    present: Mapping[int, str],
    missing: tuple[int, ...],
    *,
    round: int,
    step: int,
    streaks: Mapping[int, int],
    started: float,
    clock: Clock,
) -> Report:
    """The report of round ``round`` at ``step`` from the numbers of the ``present`` ranks
    (``rank_numbers``' text), ``streaks`` being those of the previous report. ``elapsed`` is
    ``clock.monotonic() - started`` once decided."""
    numbers = {r: json.loads(v) for r, v in present.items()}
    relative, section_relative = _relative(cfg, numbers)
    individual, section_individual, job_trend = _individual(cfg, numbers)
    stragglers = scores.find_stragglers(
        relative,
        individual,
        relative_threshold=cfg.gpu_relative_perf_threshold,
        individual_threshold=cfg.gpu_individual_perf_threshold,
    )
    new_streaks = scores.update_streaks(streaks, list(stragglers))
    demote: int | None = None
    deferred: tuple[int, ...] = ()
    if cfg.replace_if_detected:
        demote, deferred = scores.pick_demotion(
            new_streaks,
            scores.min_scores(relative, individual),
            after=cfg.replace_after_reports,
        )
    return Report(
        round=round,
        step=step,
        hosts={r: n["host"] for r, n in numbers.items()},
        relative=relative,
        individual=individual,
        section_relative=section_relative,
        section_individual=section_individual,
        stragglers=stragglers,
        streaks=new_streaks,
        demote=demote,
        deferred=deferred,
        stop=cfg.stop_if_detected and bool(stragglers),
        missing=missing,
        job_trend=job_trend,
        elapsed=clock.monotonic() - started,
    )


def _relative(
    cfg: DetectorConfig, numbers: Mapping[int, dict[str, Any]]
) -> tuple[dict[int, float], SectionScores]:
    """The relative scores of the ranks that timed something (empty when that family is off)."""
    if not cfg.calc_relative_gpu_perf:
        return {}, {}
    timed = {r: n["times"] for r, n in numbers.items() if n["times"]}
    return scores.relative_scores(timed, reference=cfg.relative_to)


def _individual(
    cfg: DetectorConfig, numbers: Mapping[int, dict[str, Any]]
) -> tuple[dict[int, float], SectionScores, float]:
    """The individual scores beyond the job's trend, per section, and the job's trend (empty
    and 1.0 when that family is off)."""
    if not cfg.calc_individual_gpu_perf:
        return {}, {}, 1.0
    individual, job_trend = scores.beyond_job_trend(
        {r: n["individual"] for r, n in numbers.items() if n["times"]}
    )
    section_individual: SectionScores = {}
    for r, n in numbers.items():
        for s, v in n["section_individual"].items():
            section_individual.setdefault(s, {})[r] = v
    return individual, section_individual, job_trend
