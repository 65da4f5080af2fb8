"""straggler.scores, straggler.schedule and straggler.decide: pure functions, checked at their
boundaries."""

from __future__ import annotations

import pytest

from restartable.inprocess.clock import Clock
from restartable.straggler import scores
from restartable.straggler.config import DetectorConfig
from restartable.straggler.decide import decide, rank_numbers
from restartable.straggler.schedule import Plan, first_plan, next_plan


def test_relative_scores_against_the_median_rank() -> None:
    medians = {0: {"step": 1.0}, 1: {"step": 2.0}, 2: {"step": 1.1}, 3: {"step": 0.5}}
    overall, per_section = scores.relative_scores(medians, reference="median")
    # The lower median of (0.5, 1.0, 1.1, 2.0) is 1.0: the fast rank 3 does not make the
    # typical ranks stragglers, and nobody scores above 1.0.
    assert overall == pytest.approx({0: 1.0, 1: 0.5, 2: 1.0 / 1.1, 3: 1.0})
    assert per_section == {"step": overall}


def test_relative_scores_against_the_best_rank() -> None:
    medians = {0: {"step": 1.0}, 1: {"step": 2.0}, 2: {"step": 0.5}}
    overall, _ = scores.relative_scores(medians, reference="best")
    assert overall == pytest.approx({0: 0.5, 1: 0.25, 2: 1.0})


def test_two_ranks_the_median_is_the_faster_one() -> None:
    overall, _ = scores.relative_scores({0: {"s": 1.0}, 1: {"s": 2.0}})
    assert overall == pytest.approx({0: 1.0, 1: 0.5})


def test_relative_weights_sections_by_reference_time_and_skips_uncommon_ones() -> None:
    medians = {
        0: {"fwd": 3.0, "opt": 1.0, "only0": 5.0},
        1: {"fwd": 6.0, "opt": 1.0},
    }
    overall, per_section = scores.relative_scores(medians, reference="best")
    assert set(per_section) == {"fwd", "opt"}  # "only0" says nothing about rank 1
    # rank 1: fwd 0.5 (weight 3), opt 1.0 (weight 1) -> 0.625
    assert overall[1] == pytest.approx((0.5 * 3 + 1.0 * 1) / 4)
    assert overall[0] == 1.0


def test_relative_scores_of_nothing() -> None:
    assert scores.relative_scores({}) == ({}, {})
    # No common section: nothing to compare, nobody is slow.
    assert scores.relative_scores({0: {"a": 1.0}, 1: {"b": 9.0}})[0] == {0: 1.0, 1: 1.0}


def test_individual_score_against_the_lower_median_of_the_window() -> None:
    history = [{"step": 1.2}, {"step": 0.8}, {"step": 1.1}, {"step": 1.0}]
    overall, per_section = scores.individual_score({"step": 2.0, "new": 1.0}, history)
    # Lower median of (0.8, 1.0, 1.1, 1.2) is 1.0: one lucky fast report does not set the bar.
    assert per_section == pytest.approx({"step": 0.5, "new": 1.0})  # "new": no history yet
    assert overall == pytest.approx((0.5 * 1.0 + 1.0 * 1.0) / 2.0)
    assert scores.individual_score({"step": 1.0}, []) == (1.0, {"step": 1.0})
    assert scores.individual_score({}, history) == (1.0, {})


def test_zero_time_is_never_slow() -> None:
    assert scores.relative_scores({0: {"s": 0.0}, 1: {"s": 0.0}})[0] == {0: 1.0, 1: 1.0}


@pytest.mark.parametrize("score, flagged", [(0.69, True), (0.7, False), (1.0, False)])
def test_find_stragglers_threshold_is_strict(score: float, flagged: bool) -> None:
    found = scores.find_stragglers(
        {0: 1.0, 1: score}, {}, relative_threshold=0.7, individual_threshold=0.7
    )
    assert (1 in found) is flagged


def test_find_stragglers_gives_every_reason() -> None:
    found = scores.find_stragglers(
        {0: 1.0, 1: 0.5}, {0: 0.6, 1: 0.4}, relative_threshold=0.7, individual_threshold=0.7
    )
    assert found == {0: ("individual 0.60",), 1: ("relative 0.50", "individual 0.40")}


def test_streaks_count_consecutive_reports_only() -> None:
    s = scores.update_streaks({}, [1, 2])
    s = scores.update_streaks(s, [1])
    assert s == {1: 2}  # rank 2 was not flagged this time: its streak ends
    assert scores.update_streaks(s, []) == {}


def test_pick_demotion_one_per_report_lowest_score_first() -> None:
    streaks = {1: 2, 2: 3, 3: 1}
    rank, deferred = scores.pick_demotion(streaks, {1: 0.3, 2: 0.5, 3: 0.1}, after=2)
    assert (rank, deferred) == (1, (2,))  # rank 3 is flagged but not yet confirmed
    assert scores.pick_demotion({1: 1}, {1: 0.1}, after=2) == (None, ())
    assert scores.pick_demotion({4: 2, 2: 2}, {4: 0.5, 2: 0.5}, after=2) == (2, (4,))


def test_section_times_are_the_lower_quartile_and_min_scores() -> None:
    assert scores.section_times({"a": [5.0, 1.0, 2.0, 4.0, 3.0], "b": []}) == {"a": 2.0}
    assert scores.section_times({"a": [7.0]}) == {"a": 7.0}
    # A few steps slowed by a neighbour do not move it; every step slower does.
    assert scores.section_times({"a": [1.0] * 8 + [3.0] * 4}) == {"a": 1.0}
    assert scores.section_times({"a": [2.0] * 12}, quantile=0.5) == {"a": 2.0}
    assert scores.min_scores({0: 0.9, 1: 0.5}, {0: 0.6}) == {0: 0.6, 1: 0.5}


# ----- schedule --------------------------------------------------------------------------------


def test_first_plan_is_a_sync_at_the_next_step() -> None:
    assert first_plan(7) == Plan(step=8, report=False, gap=1)


def test_syncs_double_until_the_report_step_is_near() -> None:
    # 0.01 s per step, 1 s interval: 100 steps. Gaps 1, 2, 4, ... until within 2 x gap.
    plan, step, since = first_plan(0), 0, 0.0
    syncs = 0
    while not plan.report:
        since += (plan.step - step) * 0.01
        step = plan.step
        plan = next_plan(
            step=step, gap=plan.gap, seconds_per_step=0.01, since_report=since, interval=1.0
        )
        syncs += 1
    assert syncs <= 7
    assert plan.step == 100  # the report lands where the interval ends


def test_after_a_report_the_next_is_planned_directly() -> None:
    plan = next_plan(step=100, gap=64, seconds_per_step=0.01, since_report=0.0, interval=1.0)
    assert plan == Plan(step=200, report=True, gap=100)
    # Steps became 3x slower: the next report comes after a third as many steps.
    plan = next_plan(step=200, gap=100, seconds_per_step=0.03, since_report=0.0, interval=1.0)
    assert plan.step == 234 and plan.report


def test_a_late_round_plans_the_report_at_the_next_step() -> None:
    plan = next_plan(step=10, gap=4, seconds_per_step=0.5, since_report=5.0, interval=1.0)
    assert plan == Plan(step=11, report=True, gap=4)


def test_plan_json_round_trip() -> None:
    p = Plan(step=3, report=True, gap=2)
    assert Plan.from_json(p.to_json()) == p


def test_a_job_wide_slowdown_is_nobody_s_individual_fault() -> None:
    adjusted, trend = scores.beyond_job_trend({0: 0.66, 1: 0.75})
    assert trend == 0.75 and adjusted == pytest.approx({0: 0.88, 1: 1.0})
    # One rank slowing down alone still stands out, with two ranks as with more.
    assert scores.beyond_job_trend({0: 1.0, 1: 0.33}) == ({0: 1.0, 1: 0.33}, 1.0)
    adjusted, trend = scores.beyond_job_trend({0: 0.9, 1: 0.95, 2: 0.3, 3: 1.0})
    assert trend == 0.95 and adjusted[2] == pytest.approx(0.3 / 0.95)
    assert scores.beyond_job_trend({0: 0.4}) == ({0: 0.4}, 1.0)  # alone: as it is
    assert scores.beyond_job_trend({}) == ({}, 1.0)


def _numbers(step: float, individual: float = 1.0) -> str:
    return rank_numbers("host", {"step": step}, individual, {"step": individual})


def test_decide_flags_the_slow_rank_counts_its_streak_and_demotes_it_when_confirmed() -> None:
    cfg = DetectorConfig(replace_if_detected=True, replace_after_reports=2)
    present = {0: _numbers(1.0), 1: _numbers(2.0, individual=0.5), 2: _numbers(1.0)}
    ticks = iter([10.5, 20.25])
    first = decide(
        cfg,
        present,
        (3,),
        round=4,
        step=40,
        streaks={},
        started=10.0,
        clock=Clock(monotonic=lambda: next(ticks)),
    )
    assert set(first.stragglers) == {1} and first.streaks == {1: 1} and first.demote is None
    assert first.relative[1] == pytest.approx(0.5) and first.missing == (3,)
    assert first.section_individual == {"step": {0: 1.0, 1: 0.5, 2: 1.0}}
    assert (first.round, first.step, first.elapsed) == (4, 40, 0.5)
    second = decide(
        cfg,
        present,
        (),
        round=5,
        step=50,
        streaks=first.streaks,
        started=20.0,
        clock=Clock(monotonic=lambda: next(ticks)),
    )
    assert second.streaks == {1: 2} and second.demote == 1 and not second.stop


def test_decide_with_both_families_off_flags_nobody() -> None:
    cfg = DetectorConfig(calc_relative_gpu_perf=False, calc_individual_gpu_perf=False)
    present = {0: _numbers(1.0), 1: _numbers(5.0, individual=0.1)}
    report = decide(
        cfg,
        present,
        (),
        round=1,
        step=1,
        streaks={1: 3},
        started=0.0,
        clock=Clock(monotonic=lambda: 0.0),
    )
    assert report.relative == {} and report.individual == {} and report.job_trend == 1.0
    assert report.stragglers == {} and report.streaks == {}
