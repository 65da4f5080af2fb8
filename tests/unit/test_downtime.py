"""Downtime terms from journal records: they add up to the wall time, and a fault's downtime is
the gap in rank 0's progress around it."""

from __future__ import annotations

from typing import Any

import pytest

from inprocess import downtime


def _steps(t0: float, first: int, n: int, dt: float, it: int) -> list[dict[str, Any]]:
    return [
        {"t": t0 + i * dt, "event": "step", "step": first + i, "training_rank": 0, "iteration": it}
        for i in range(n)
    ]


def _run_with_one_fault() -> list[dict[str, Any]]:
    recs: list[dict[str, Any]] = [{"t": 0.0, "event": "job_start"}]
    recs += _steps(1.0, 0, 11, 0.1, 0)  # steps 0..10 at 1.0 .. 2.0
    recs += [
        {"t": 2.05, "event": "fault_fired", "iteration": 0, "kind": "hang"},
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
