"""Downtime terms from journal records: they add up to the wall time, and a fault's downtime is
the gap in rank 0's progress around it."""

from __future__ import annotations

from typing import Any

import pytest

from inprocess import downtime, report


def _steps(t0: float, first: int, n: int, dt: float, it: int) -> list[dict[str, Any]]:
    return [
        {"t": t0 + i * dt, "event": "step", "step": first + i, "training_rank": 0, "iteration": it}
        for i in range(n)
    ]


def _run_with_one_fault() -> list[dict[str, Any]]:
    recs: list[dict[str, Any]] = [{"t": 0.0, "event": "job_start"}]
    recs += _steps(1.0, 0, 11, 0.1, 0)  # steps 0..10 at 1.0 .. 2.0
    recs += [
        {"t": 2.05, "event": "fault_fired", "iteration": 0, "kind": "hang",
         "fault": "hang@rank1:step10"},
        {"t": 4.05, "event": "fault", "iteration": 0, "kind": "soft_timeout", "fault_rank": 1},
        {"t": 4.2, "event": "iteration_start", "iteration": 1},
        {"t": 4.3, "event": "restart", "iteration": 1, "cause": "soft_timeout on rank 1",
         "faulting_ranks": [1], "phases": {}},
        {"t": 4.4, "event": "restore", "iteration": 1, "training_rank": 0, "tier": "memory",
         "step": 8},
    ]  # fmt: skip
    recs += _steps(4.5, 8, 13, 0.1, 1)  # steps 8..20 at 4.5 .. 5.7; step 10 again at 4.7
    recs += [{"t": 6.0, "event": "job_end"}]
    return sorted(recs, key=lambda r: r["t"])


def test_terms_of_a_hang_and_their_sum() -> None:
    r = downtime.build(_run_with_one_fault())
    (w,) = r.windows
    t = w.terms
    assert t["lost_before"] == pytest.approx(0.05)
    assert t["detection"] == pytest.approx(2.0)  # the soft timeout is detection, not restart
    assert t["restart"] == pytest.approx(0.15)
    assert t["reload"] == pytest.approx(0.2)
    assert t["redo"] == pytest.approx(0.3)  # steps 8, 9 again; back at step 10 at 4.7
    assert t["downtime"] == pytest.approx(4.7 - 2.0)
    assert r.wall == pytest.approx(6.0)
    assert r.startup + r.productive + r.downtime == pytest.approx(r.wall)
    assert (w.tier, w.restored_step, w.reached_step) == ("memory", 8, 10)


def test_a_second_restart_inside_a_window_extends_it() -> None:
    recs = _run_with_one_fault()
    recs += [
        {"t": 4.45, "event": "fault", "iteration": 1, "kind": "exception", "fault_rank": 0},
        {"t": 4.46, "event": "iteration_start", "iteration": 2},
        {"t": 4.47, "event": "restart", "iteration": 2, "cause": "exception on rank 0",
         "faulting_ranks": [0], "phases": {}},
    ]  # fmt: skip
    r = downtime.build(sorted(recs, key=lambda x: x["t"]))
    assert len(r.windows) == 1
    assert r.windows[0].last == pytest.approx(2.0) and r.windows[0].back == pytest.approx(4.7)


def test_a_journal_without_steps_says_what_to_do() -> None:
    with pytest.raises(ValueError, match=r"ctx.ping\(step\)"):
        downtime.build([{"t": 0.0, "event": "job_start"}, {"t": 1.0, "event": "job_end"}])


def test_the_window_names_the_injected_fault_in_the_dict_and_the_text() -> None:
    r = downtime.build(_run_with_one_fault())
    assert r.windows[0].fault == "hang@rank1:step10"
    (row,) = r.as_dict()["faults"]
    assert row["fault"] == "hang@rank1:step10" and row["kind"] == "soft_timeout"
    terms = ("lost_before_s", "detection_s", "restart_s", "reload_s", "redo_s")
    assert sum(row[k] for k in terms) == pytest.approx(row["downtime_s"])
    text = report.format_report(r)
    assert "hang@rank1:step10" in text
    # Every column says its unit; no "seconds(steps)" packed into one cell.
    for header in ("lost-before [s]", "detect [s]", "restart [s]", "reload [s]", "redo [s]",
                   "downtime [s]", "from step", "back at step"):  # fmt: skip
        assert header in text
    (row_text,) = [line for line in text.splitlines() if "hang@rank1:step10" in line]
    assert "(" not in row_text and "2.700" in row_text


def test_a_fault_that_was_not_injected_has_no_name() -> None:
    recs = [r for r in _run_with_one_fault() if r["event"] != "fault_fired"]
    (w,) = downtime.build(recs).windows
    assert w.fault is None and w.sign == pytest.approx(4.05)  # its first sign: the fault record
    rows = [line for line in report.format_report(downtime.build(recs)).splitlines()]
    assert any(line.startswith("  -  ") and "soft_timeout" in line for line in rows), rows


def test_checkpoint_stalls_count_outside_fault_windows_only() -> None:
    recs = _run_with_one_fault()
    recs += [
        {"t": 1.5, "event": "save", "training_rank": 0, "stall_s": 0.01},
        {"t": 3.0, "event": "save", "training_rank": 0, "stall_s": 0.5},  # inside the window
        {"t": 5.0, "event": "save", "training_rank": 0, "stall_s": 0.02},
        {"t": 5.0, "event": "save", "training_rank": 1, "stall_s": 0.7},  # rank 0's only
    ]
    r = downtime.build(sorted(recs, key=lambda x: x["t"]))
    assert r.checkpoint == pytest.approx(0.03)
    assert r.downtime == pytest.approx(0.03 + r.windows[0].terms["downtime"])
    assert r.startup + r.productive + r.downtime == pytest.approx(r.wall)
    assert r.goodput == pytest.approx(r.productive / r.wall)


def test_a_dead_rank_is_detected_by_the_first_fault_record_of_its_peers() -> None:
    # A killed rank writes no fault record: its peer's failed collective is the detection.
    recs = [r for r in _run_with_one_fault() if r["event"] != "fault"]
    recs += [
        {"t": 2.3, "event": "fault", "iteration": 0, "kind": "collective", "fault_rank": 0,
         "in_collective": True},
    ]  # fmt: skip
    (w,) = downtime.build(sorted(recs, key=lambda x: x["t"])).windows
    assert w.terms["detection"] == pytest.approx(0.25)
    assert w.terms["restart"] == pytest.approx(4.2 - 2.3)
