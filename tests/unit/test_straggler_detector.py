"""straggler.Detector in one process: bad input, sections, and report rounds of several ranks
(threads, each with its own client of a real TCPStore and a fake CPU clock)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from torch.distributed import TCPStore

from restartable.inprocess.clock import Clock
from restartable.straggler import ConfigError, Detector, DetectorConfig, Report, SectionError
from tests.fake_clock import FakeClock


@dataclass
class FakeContext:
    """The duck-typed part of inprocess.RestartContext that the detector uses."""

    store: Any
    rank: int
    world_size: int
    reserve: bool = True
    asked: list[tuple[int, str, str]] = field(default_factory=list)

    def replace_rank(self, rank: int, *, reason: str, tag: str) -> bool:
        self.asked.append((rank, reason, tag))
        return self.reserve


# ----- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options, match",
    [
        ({"gpu_relative_perf_threshold": 0.0}, r"gpu_relative_perf_threshold \(0.0\) must be in"),
        ({"gpu_individual_perf_threshold": 1.5}, r"gpu_individual_perf_threshold \(1.5\)"),
        ({"report_time_interval": 0}, r"report_time_interval \(0\) must be a finite number"),
        ({"report_time_interval": float("inf")}, r"report_time_interval \(inf\)"),
        ({"gather_timeout": -1.0}, r"gather_timeout \(-1.0\)"),
        ({"profiling_interval": 0}, r"profiling_interval \(0\) must be an integer >= 1"),
        ({"replace_after_reports": 0}, r"replace_after_reports \(0\)"),
        ({"relative_to": "mean"}, r"relative_to \('mean'\) must be one of"),
        (
            {"calc_relative_gpu_perf": False, "calc_individual_gpu_perf": False,
             "stop_if_detected": True},
            r"need a score",
        ),
        ({"no_such_option": 1}, r"the options are DetectorConfig's"),
    ],
)  # fmt: skip
def test_bad_options_name_the_field(options: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Detector(**options)


def test_defaults_are_the_seeds() -> None:
    c = DetectorConfig()
    assert (
        c.report_time_interval,
        c.calc_relative_gpu_perf,
        c.calc_individual_gpu_perf,
        c.num_gpu_perf_scores_to_print,
        c.gpu_relative_perf_threshold,
        c.gpu_individual_perf_threshold,
        c.stop_if_detected,
        c.profiling_interval,
    ) == (300.0, True, True, 5, 0.7, 0.7, False, 1)


def test_several_ranks_need_a_store_and_a_valid_rank() -> None:
    with pytest.raises(ConfigError, match=r"needs a store for world_size 2"):
        Detector(rank=0, world_size=2)
    with pytest.raises(ConfigError, match=r"rank \(2\) must be in 0..world_size-1 \(1\)"):
        Detector(rank=2, world_size=2, store=object())
    with pytest.raises(ConfigError, match=r"context= and store"):
        Detector(context=FakeContext(object(), 0, 1), store=object())


def test_replace_without_restartable_is_ignored_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="restartable.straggler"):
        Detector(replace_if_detected=True, timer="cpu")
    assert "replace_if_detected is ignored" in caplog.text


def test_auto_timer_times_the_cpu_in_a_gloo_group_also_where_cuda_is_available(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A gloo job trains on the CPU: CUDA events on the idle GPU would time nothing.
    import torch
    import torch.distributed as dist

    from restartable.straggler.timing import cuda_timing

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cuda_timing("auto")  # no group: CUDA where available
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert not cuda_timing("auto")
        assert cuda_timing("cuda")  # asked for explicitly
    finally:
        dist.destroy_process_group()


def test_a_section_nested_in_itself_raises_and_others_nest() -> None:
    det = Detector(timer="cpu")
    with (
        det.section("step"),
        det.section("fwd"),
        pytest.raises(SectionError, match=r"section 'step' was entered while it is open"),
    ):
        det.section("step").__enter__()
    with det.section("step"):  # still usable afterwards
        pass
    with pytest.raises(ConfigError, match=r"section name \(''\)"):
        det.section("")


def test_profiling_interval_times_every_nth_entry() -> None:
    clock = FakeClock(0.0)
    det = Detector(timer="cpu", profiling_interval=3, cpu_clock=clock)
    for i in range(9):
        with det.section("step"):
            clock.now += float(i)
    assert det.section("step").drain() == [2.0, 5.0, 8.0]


# ----- rounds ----------------------------------------------------------------------------------


def run_ranks(
    n: int,
    *,
    steps: int,
    cost: Callable[[int, int], float],
    skip: frozenset[int] = frozenset(),
    reserve: bool = True,
    **options: Any,
) -> tuple[list[list[Report]], list[FakeContext], list[Detector]]:
    """``n`` ranks as threads; rank r's step s costs ``cost(r, s)`` CPU seconds. Ranks in
    ``skip`` never call ``report_if_due`` (dead, or a bug)."""
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    reports: list[list[Report]] = [[] for _ in range(n)]
    contexts = [
        FakeContext(
            TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False),
            r,
            n,
            reserve=reserve,
        )
        for r in range(n)
    ]
    clocks = [FakeClock(0.0) for _ in range(n)]
    config = DetectorConfig(**{"report_time_interval": 1e-4, "timer": "cpu", **options})
    dets = [
        Detector(config, context=contexts[r], cpu_clock=clocks[r], host=f"node{r}")
        for r in range(n)
    ]
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            for s in range(steps):
                with dets[r].section("step"):
                    clocks[r].now += cost(r, s)
                if r in skip:
                    continue
                report = dets[r].report_if_due(s)
                if report is not None:
                    reports[r].append(report)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)
    return reports, contexts, dets


def test_every_rank_gets_the_same_report_and_the_slow_rank_is_found() -> None:
    reports, _, _ = run_ranks(3, steps=12, cost=lambda r, s: 2.0 if r == 2 else 1.0)
    assert reports[0] and reports[0] == reports[1] == reports[2]
    for report in reports[0]:
        assert report.relative == pytest.approx({0: 1.0, 1: 1.0, 2: 0.5})
        assert report.stragglers == {2: ("relative 0.50",)}
        assert report.hosts == {0: "node0", 1: "node1", 2: "node2"}
        assert report.missing == ()
    assert [r.streaks[2] for r in reports[0]] == list(range(1, len(reports[0]) + 1))


def test_clean_ranks_report_no_straggler() -> None:
    reports, contexts, dets = run_ranks(
        3, steps=12, cost=lambda r, s: 1.0 + 0.05 * r, replace_if_detected=True
    )
    assert reports[0] and all(not rep.stragglers for rep in reports[0])
    assert not any(c.asked for c in contexts) and not any(d.should_stop for d in dets)


def test_individual_score_sees_a_rank_slow_down() -> None:
    reports, _, _ = run_ranks(
        2,
        steps=16,
        cost=lambda r, s: 3.0 if (r == 1 and s >= 8) else 1.0,
        calc_relative_gpu_perf=False,
    )
    # One report per step here; the window is individual_window (5) reports, its lower median
    # turns slow once 3 of them are: flagged in 3 reports.
    before = [rep for rep in reports[0] if rep.step < 8]
    after = [rep for rep in reports[0] if 8 <= rep.step < 8 + 3]
    adapted = [rep for rep in reports[0] if rep.step >= 8 + 3]
    assert before and not any(rep.stragglers for rep in before)
    assert after and all(rep.stragglers[1] == ("individual 0.33",) for rep in after)
    # A lasting change ages out of the window: the baseline follows instead of flagging forever.
    assert adapted and not any(rep.stragglers for rep in adapted)
    assert all(rep.relative == {} for rep in reports[0])


def test_a_job_wide_slowdown_is_reported_but_nobody_is_a_straggler() -> None:
    reports, _, _ = run_ranks(3, steps=12, cost=lambda r, s: 2.0 if s >= 6 else 1.0)
    late = [rep for rep in reports[0] if 6 <= rep.step < 9]
    assert late and all(rep.job_trend == pytest.approx(0.5) for rep in late)
    assert not any(rep.stragglers for rep in reports[0])
    assert "job speed against its recent past: 0.50" in late[0].format(5)


def test_a_confirmed_straggler_asks_for_its_own_demotion_once_per_report() -> None:
    reports, contexts, _ = run_ranks(
        3,
        steps=8,
        cost=lambda r, s: 2.0 if r == 2 else 1.0,
        replace_if_detected=True,
        replace_after_reports=2,
    )
    first, second = reports[0][:2]
    assert first.demote is None and second.demote == 2  # flagged in 2 consecutive reports
    # Every rank asks for the same swap (they all wait for the restart it causes).
    assert contexts[0].asked == contexts[1].asked == contexts[2].asked
    rank, reason, tag = contexts[0].asked[0]
    assert rank == 2 and tag == f"straggler-{second.round}"
    assert reason.startswith("straggler in 2 consecutive reports (relative 0.50)")


def test_two_confirmed_stragglers_one_demotion_per_report() -> None:
    reports, _, _ = run_ranks(
        4,
        steps=6,
        cost=lambda r, s: {2: 2.0, 3: 3.0}.get(r, 1.0),
        replace_if_detected=True,
        replace_after_reports=1,
    )
    assert reports[0][0].demote == 3 and reports[0][0].deferred == (2,)
    assert "deferred: rank(s) [2]" in reports[0][0].format(5)


def test_stop_if_detected_stops_every_rank_at_the_same_report() -> None:
    reports, _, dets = run_ranks(
        2, steps=6, cost=lambda r, s: 2.0 if r == 1 else 1.0, stop_if_detected=True
    )
    assert all(d.should_stop for d in dets)
    assert reports[0][0].stop and reports[0][0] == reports[1][0]


def test_a_rank_that_never_reports_is_missing_and_nobody_hangs() -> None:
    t0 = time.monotonic()
    reports, _, _ = run_ranks(
        3, steps=3, cost=lambda r, s: 1.0, skip=frozenset({2}), gather_timeout=0.3
    )
    assert reports[0] and reports[0] == reports[1]
    assert all(rep.missing == (2,) for rep in reports[0])
    assert set(reports[0][0].relative) == {0, 1}
    assert time.monotonic() - t0 < 20


def test_report_is_one_log_record_with_worst_best_and_hosts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="restartable.straggler"):
        run_ranks(
            2, steps=3, cost=lambda r, s: 2.0 if r == 1 else 1.0, num_gpu_perf_scores_to_print=1
        )
    records = [r for r in caplog.records if "straggler report" in r.getMessage()]
    assert records and all(r.levelno == logging.INFO for r in records)
    text = records[0].getMessage()
    assert "relative performance: worst 1/2 ranks:\n  rank=1 host=node1 score=0.50" in text
    assert "relative performance: best 1/2 ranks:\n  rank=0 host=node0 score=1.00" in text
    assert "stragglers: rank 1 (node1: relative 0.50, 1 report(s) in a row)" in text


def test_report_json_round_trip() -> None:
    rep = Report(
        round=2,
        step=9,
        hosts={0: "a", 1: "b"},
        relative={0: 1.0, 1: 0.5},
        individual={0: 1.0, 1: 0.9},
        section_relative={"step": {0: 1.0, 1: 0.5}},
        stragglers={1: ("relative 0.50",)},
        streaks={1: 1},
        demote=1,
        missing=(2,),
    )
    assert Report.from_json(rep.to_json()) == rep


def test_without_store_a_single_rank_reports_on_its_own() -> None:
    clock, wall = FakeClock(0.0), FakeClock(0.0)  # one second per step, a report every 10 seconds
    det = Detector(
        timer="cpu", report_time_interval=10.0, cpu_clock=clock, clock=Clock(monotonic=wall)
    )
    got = []
    for s in range(60):
        with det.section("step"):
            clock.now += 1.0
        wall.now += 1.0
        rep = det.report_if_due(s)
        if rep is not None:
            got.append(rep)
    assert [rep.step for rep in got] == [10, 20, 30, 40, 50]  # syncs at 1, 2, 4, 8 first
    assert got[-1].relative == {0: 1.0} and not got[-1].stragglers
