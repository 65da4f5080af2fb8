"""Computed section timeouts: the estimator, ft_state.json and the section clock (fake clock)."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import pytest

from restartable.inprocess.errors import SectionError
from restartable.inprocess.timeouts.estimator import MIN_SAMPLES, WARMUP, TimeoutEstimator
from restartable.inprocess.timeouts.sections import SectionClock
from restartable.inprocess.timeouts.state_file import read_state, write_state
from tests.fake_clock import FakeClock


def feed(est: TimeoutEstimator, key: str, durations: list[float]) -> None:
    for d in durations:
        est.observe(key, d)


def warm(est: TimeoutEstimator, key: str = "step", seconds: float = 2.0) -> None:
    feed(est, key, [seconds] * WARMUP[key])


# ----- estimator -----------------------------------------------------------------------------


def test_warmup_steps_neither_poison_the_estimate_nor_are_judged() -> None:
    est = TimeoutEstimator(safety_factor=5.0)
    est.begin_iteration()
    warm(est, seconds=3.0)  # slow first steps (imports, DDP buckets, peers starting)
    feed(est, "step", [0.04, 0.05, 0.03] + [0.04] * (MIN_SAMPLES["step"] - 3))
    limit = est.limit("step")
    assert limit.source == "learned"
    assert limit.seconds == pytest.approx(0.25)  # 5 x 0.05, not 5 x 3.0
    # A restart: its first steps are judged by nothing learned (no configured value here).
    est.begin_iteration()
    assert est.limit("step").seconds is None
    warm(est, seconds=1.5)
    assert est.limit("step").seconds == pytest.approx(0.25)  # learning kept across restarts


def test_timeout_tightens_from_the_configured_value_once_enough_steps_were_seen() -> None:
    est = TimeoutEstimator(safety_factor=5.0, configured={"step": 180.0})
    est.begin_iteration()
    warm(est)
    seen = []
    for _ in range(MIN_SAMPLES["step"]):
        seen.append(est.limit("step").seconds)
        est.observe("step", 0.1)
    assert seen == [180.0] * MIN_SAMPLES["step"]  # not enough evidence yet: the bound holds
    assert est.limit("step").seconds == pytest.approx(0.5)
    est.observe("step", 0.2)  # the max grows with a slower step: never a false alarm later
    assert est.limit("step").seconds == pytest.approx(1.0)


def test_learned_values_have_a_floor_and_configured_values_stay_upper_bounds() -> None:
    est = TimeoutEstimator(safety_factor=5.0, configured={"checkpointing": 0.5})
    est.begin_iteration()
    warm(est)
    feed(est, "step", [0.001] * MIN_SAMPLES["step"])
    assert est.limit("step").seconds == pytest.approx(0.1)  # floor, not 5 ms
    warm(est, "checkpointing")
    feed(est, "checkpointing", [0.4] * MIN_SAMPLES["checkpointing"])  # 5 x 0.4 = 2.0 > 0.5
    assert est.limit("checkpointing").seconds == 0.5
    assert est.limit("checkpointing").source == "configured"
    assert est.learned()["checkpointing"] == 0.5


def test_irregular_keys_only_tighten_a_configured_bound_never_below_soft_timeout() -> None:
    est = TimeoutEstimator(safety_factor=5.0, soft_floor=2.0, configured={"setup": 600.0})
    est.begin_iteration()
    # Gaps between sections: nothing configured, so nothing learned (evaluation every N steps
    # out of section would otherwise be killed by a limit learned from millisecond gaps).
    feed(est, "out_of_section", [0.0001] * (WARMUP["out_of_section"] + 20))
    assert est.limit("out_of_section").seconds is None
    est.configured = {"setup": 600.0, "out_of_section": 300.0}
    assert est.limit("out_of_section").seconds == 2.0
    est.observe("setup", 0.3)
    assert est.limit("setup").seconds == 2.0  # tighter than 600 s, never below soft_timeout
    est.observe("setup", 30.0)
    assert est.limit("setup").seconds == 150.0


def test_a_stored_value_is_enforced_only_after_this_run_confirmed_it() -> None:
    est = TimeoutEstimator(safety_factor=5.0)
    est.begin_iteration({"step": 0.3})
    warm(est)
    assert est.limit("step").seconds is None  # not measured in this run yet
    est.observe("step", 0.05)  # 2 x 0.05 <= 0.3: it fits with room to spare
    assert (est.limit("step").seconds, est.limit("step").source) == (0.3, "stored")
    feed(est, "step", [0.05] * MIN_SAMPLES["step"])
    assert est.limit("step").source == "learned"  # own evidence beats the file


def test_a_stale_stored_value_is_dropped_not_enforced(caplog: pytest.LogCaptureFixture) -> None:
    # The file came from a faster model: the new model's steps take 1 s.
    est = TimeoutEstimator(safety_factor=5.0, configured={"step": 60.0})
    est.begin_iteration({"step": 0.3})
    warm(est, seconds=1.5)
    with caplog.at_level(logging.WARNING, logger="restartable.inprocess.timeouts"):
        est.observe("step", 1.0)  # healthy and slower than 0.3 s: no fault, the value goes
    assert "no longer fits" in caplog.text and "step" in caplog.text
    assert est.limit("step").seconds == 60.0  # the configured bound, until learned again
    assert "step" not in est.learned()
    feed(est, "step", [1.0] * MIN_SAMPLES["step"])
    assert est.limit("step").seconds == pytest.approx(5.0)


def test_a_stored_value_does_not_replace_own_learning_at_a_restart() -> None:
    est = TimeoutEstimator(safety_factor=5.0)
    est.begin_iteration()
    warm(est)
    feed(est, "step", [0.1] * MIN_SAMPLES["step"])
    est.begin_iteration({"step": 9.0})  # a restart re-reads the file
    warm(est)
    assert est.limit("step").seconds == pytest.approx(0.5)


# ----- ft_state.json ---------------------------------------------------------------------------


def test_state_round_trip_is_atomic_and_keeps_only_known_keys(tmp_path: Path) -> None:
    path = tmp_path / "run" / "ft_state.json"
    write_state(path, {"step": 0.25, "setup": 12.0}, safety_factor=5.0)
    assert read_state(path) == {"step": 0.25, "setup": 12.0}
    assert [p.name for p in path.parent.iterdir()] == ["ft_state.json"]  # no temporary left
    write_state(path, {"step": 0.2}, safety_factor=5.0)
    assert read_state(path) == {"step": 0.2}
    assert read_state(tmp_path / "missing.json") == {}


@pytest.mark.parametrize(
    "text",
    [
        "{not json",
        "",
        json.dumps({"version": 99, "timeouts": {"step": 1.0}}),
        json.dumps({"version": 1, "timeouts": [1, 2]}),
    ],
)
def test_a_corrupt_state_file_is_ignored_with_a_warning_naming_it(
    tmp_path: Path, text: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "ft_state.json"
    path.write_text(text)
    with caplog.at_level(logging.WARNING, logger="restartable.inprocess.timeouts.state_file"):
        assert read_state(path) == {}
    assert str(path) in caplog.text


def test_bad_values_in_the_state_file_are_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "ft_state.json"
    timeouts = {"step": -1, "setup": "x", "stepp": 1.0, "checkpointing": 2.0}
    path.write_text(json.dumps({"version": 1, "timeouts": timeouts}))
    with caplog.at_level(logging.WARNING, logger="restartable.inprocess.timeouts.state_file"):
        assert read_state(path) == {"checkpointing": 2.0}
    assert "stepp" in caplog.text and str(path) in caplog.text


# ----- the section clock -------------------------------------------------------------------


def clock_for(
    tmp_path: Path | None = None, *, configured: dict[str, float] | None = None
) -> tuple[SectionClock, FakeClock]:
    fake = FakeClock()
    est = TimeoutEstimator(safety_factor=5.0, configured=configured or {})
    path = None if tmp_path is None else str(tmp_path / "ft_state.json")
    return SectionClock(estimator=est, learn=True, state_path=path, clock=fake.clock()), fake


def run_steps(sc: SectionClock, fake: FakeClock, n: int, seconds: float) -> None:
    for _ in range(n):
        with sc.section("step"):
            fake.now += seconds
        fake.now += 0.001


def test_an_open_section_past_its_learned_timeout_is_an_overrun() -> None:
    sc, fake = clock_for()
    sc.begin_iteration(writer=False)
    run_steps(sc, fake, WARMUP["step"] + MIN_SAMPLES["step"], 0.04)
    with sc.section("step"):
        fake.now += 0.19
        assert sc.overrun() is None
        fake.now += 0.02  # 0.21 s > 5 x 0.04
        over = sc.overrun()
        assert over is not None and over.section == "step" and over.source == "learned"
        assert "section 'step' ran 0.210 s, past its learned timeout of 0.200 s" in over.detail()
        assert sc.overrun(grace=1.0) is None  # a rank waiting on peers gets the limit again
        assert sc.tick(1.0) <= 0.2 / 8  # the monitor looks often enough to see it in time
    sc.end_iteration()
    with sc.section("step"):  # after train() left, nothing is judged
        fake.now += 10.0
        assert sc.overrun() is None


def test_gaps_between_sections_are_out_of_section() -> None:
    sc, fake = clock_for(configured={"step": 10.0, "out_of_section": 10.0})
    est = sc.estimator
    est.soft_floor = 0.1
    sc.begin_iteration(writer=False)
    fake.now += 50.0  # before the first section: the progress probe's business only
    run_steps(sc, fake, WARMUP["out_of_section"] + MIN_SAMPLES["out_of_section"] + 1, 0.01)
    assert est.limit("out_of_section").seconds == pytest.approx(0.1)
    fake.now += 0.5
    over = sc.overrun()
    assert over is not None and over.section == "out_of_section"


def test_section_misuse_raises_section_error() -> None:
    sc, _ = clock_for()
    sc.begin_iteration(writer=False)
    with (
        pytest.raises(SectionError, match=r"section name \('stepp'\) must be one of"),
        sc.section("stepp"),
    ):
        pass
    with sc.section("step"):
        with (
            pytest.raises(SectionError, match="'step' opened inside itself"),
            sc.section("step"),
        ):
            pass
        with sc.section("checkpointing"):  # different sections may nest
            pass
    errors: list[BaseException] = []

    def other() -> None:
        try:
            with sc.section("step"):
                pass
        except SectionError as e:
            errors.append(e)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert errors and "sections time the thread that runs train()" in str(errors[0])


def test_a_configured_section_timeout_replaces_a_shorter_soft_timeout_inside_it() -> None:
    sc, _ = clock_for(configured={"checkpointing": 420.0})
    sc.begin_iteration(writer=False)
    assert sc.stall_limit(60.0) == 60.0
    with sc.section("checkpointing"):
        assert sc.stall_limit(60.0) == 420.0
    with sc.section("step"):
        assert sc.stall_limit(60.0) == 60.0


def test_a_section_cut_short_is_not_a_duration() -> None:
    sc, fake = clock_for()
    sc.begin_iteration(writer=False)
    run_steps(sc, fake, WARMUP["step"] + MIN_SAMPLES["step"], 0.04)
    with pytest.raises(KeyError), sc.section("step"):
        fake.now += 30.0
        raise KeyError("user bug")
    assert sc.estimator.limit("step").seconds == pytest.approx(0.2)


def test_the_writer_persists_what_it_learned_and_a_relaunch_reads_it(tmp_path: Path) -> None:
    sc, fake = clock_for(tmp_path)
    sc.begin_iteration(writer=True)
    run_steps(sc, fake, WARMUP["step"] + MIN_SAMPLES["step"], 0.04)
    # Written as soon as a value is learned (not only at the end: a job that is killed keeps it).
    assert read_state(tmp_path / "ft_state.json") == {"step": pytest.approx(0.2)}
    sc.end_iteration()
    other, fake2 = clock_for(tmp_path)  # the next launch
    other.begin_iteration(writer=False)
    run_steps(other, fake2, WARMUP["step"] + 1, 0.03)  # 5 x 0.03 <= 0.2: confirmed
    limit = other.estimator.limit("step")
    assert (limit.seconds, limit.source) == (pytest.approx(0.2), "stored")


def test_a_non_writer_never_writes(tmp_path: Path) -> None:
    sc, fake = clock_for(tmp_path)
    sc.begin_iteration(writer=False)
    run_steps(sc, fake, WARMUP["step"] + MIN_SAMPLES["step"], 0.04)
    sc.end_iteration()
    assert not (tmp_path / "ft_state.json").exists()


def test_a_corrupt_file_at_launch_is_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "ft_state.json").write_text("\x00garbage")
    sc, fake = clock_for(tmp_path)
    with caplog.at_level(logging.WARNING):
        sc.begin_iteration(writer=True)
    assert "ft_state.json" in caplog.text
    run_steps(sc, fake, WARMUP["step"] + MIN_SAMPLES["step"], 0.04)
    sc.end_iteration()
    assert read_state(tmp_path / "ft_state.json") == {"step": pytest.approx(0.2)}
