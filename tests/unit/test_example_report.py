"""The example's downtime report arithmetic (the fault plan is tested in test_faults.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from inprocess.faults import FiredFault

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from report import build_report, format_report


def _write(run_dir: Path, events: list[dict[str, object]]) -> None:
    lines = "".join(json.dumps(e) + "\n" for e in events)
    (run_dir / "rank0.jsonl").write_text(lines)


def test_report_terms_add_up(tmp_path: Path) -> None:
    # 10 steps of 0.1 s; an exception after step 4 at t=1.05; back in train() at 1.45 with a
    # restore of step 4 (0.05 s); 2 saves of 0.01 s; a NaN re-run at step 8.
    ev: list[dict[str, object]] = [{"ev": "start", "t": 0.0, "initial_rank": 0}]
    ev.append({"ev": "enter", "t": 0.5, "iteration": 0, "rank": 0})
    ev.append({"ev": "restored", "t": 0.5, "iteration": 0, "rank": 0, "step": 0, "seconds": 0.0})
    t = 0.5
    for step in range(5):
        t += 0.1
        ev.append({"ev": "step", "t": t, "step": step, "rank": 0, "seconds": 0.1})
    ev.append({"ev": "save", "t": t, "step": 5, "rank": 0, "stall": 0.01})
    ev.append({"ev": "enter", "t": 1.45, "iteration": 1, "rank": 0, "restart": {"detect_s": 0.1}})
    ev.append(
        {
            "ev": "restored",
            "t": 1.5,
            "iteration": 1,
            "rank": 0,
            "step": 4,
            "seconds": 0.05,
            "tier": "memory",
        }
    )
    t = 1.5
    for step in range(4, 10):
        t += 0.1
        ev.append({"ev": "step", "t": t, "step": step, "rank": 0, "seconds": 0.1})
    ev.append({"ev": "save", "t": t, "step": 10, "rank": 0, "stall": 0.01})
    ev.append({"ev": "rerun", "t": 2.0, "step": 8, "rank": 0, "detect_s": 0.001, "rerun_s": 0.2})
    ev.append({"ev": "done", "t": t, "rank": 0, "step": 10, "loss": 1.5})
    _write(tmp_path, ev)
    # As the example passes them: the records inprocess.faults wrote before each fault fired.
    faults = [
        FiredFault("exception@rank0:step5", "exception", 0, 0, 0, 5, time=1.05, pid=1).as_dict(),
        FiredFault("nan@rank0:step8", "nan", 0, 0, 1, 8, time=1.95, pid=1).as_dict(),
    ]
    report = build_report(tmp_path, faults=faults, wall_end=2.1)
    exc, nan = report["faults"]
    assert exc["tier"] == "memory" and exc["restored_step"] == 4
    assert exc["lost_steps"] == 1  # step 4 ran before the fault and again after the restore
    assert exc["detection_s"] == pytest.approx(0.1)
    assert exc["shutdown_restart_s"] == pytest.approx(0.3)
    assert exc["downtime_s"] == pytest.approx(0.1 + 0.3 + 0.05 + 0.1)
    assert nan["downtime_s"] == pytest.approx(0.201) and nan["shutdown_restart_s"] == 0.0
    tot = report["totals"]
    assert tot["restarts"] == 1 and tot["checkpoint_saves"] == 2
    assert tot["downtime_s"] == pytest.approx(0.02 + exc["downtime_s"] + nan["downtime_s"])
    assert tot["startup_s"] + tot["productive_s"] + tot["downtime_s"] == pytest.approx(2.1)
    assert tot["goodput"] == pytest.approx(tot["productive_s"] / 2.1, abs=1e-3)
    assert "goodput" in format_report(report)


def test_nan_with_rollback_counts_rerun_as_detection(tmp_path: Path) -> None:
    ev: list[dict[str, object]] = [{"ev": "start", "t": 0.0, "initial_rank": 0}]
    ev.append({"ev": "enter", "t": 0.1, "iteration": 0, "rank": 0})
    for step in range(3):
        ev.append({"ev": "step", "t": 0.2 + 0.1 * step, "step": step, "rank": 0, "seconds": 0.1})
    # NaN at step 3 (t=0.45): re-run until 0.65, verdict rolls back; train() re-entered at 0.8.
    ev.append(
        {
            "ev": "rerun",
            "t": 0.65,
            "step": 3,
            "rank": 0,
            "detect_s": 0.001,
            "rerun_s": 0.2,
            "verdict": "transient_error",
        }
    )
    ev.append({"ev": "enter", "t": 0.8, "iteration": 1, "rank": 0})
    ev.append(
        {
            "ev": "restored",
            "t": 0.85,
            "iteration": 1,
            "rank": 0,
            "step": 3,
            "seconds": 0.05,
            "tier": "memory",
        }
    )
    ev.append({"ev": "step", "t": 0.95, "step": 3, "rank": 0, "seconds": 0.1})
    ev.append({"ev": "done", "t": 0.95, "rank": 0, "step": 4, "loss": 1.0})
    _write(tmp_path, ev)
    faults = [{"fault": "nan@rank0:step3", "kind": "nan", "time": 0.45}]
    (nan,) = build_report(tmp_path, faults=faults, wall_end=1.0)["faults"]
    assert nan["verdict"] == "transient_error" and nan["tier"] == "memory"
    assert nan["detection_s"] == pytest.approx(0.2)
    assert nan["shutdown_restart_s"] == pytest.approx(0.8 - 0.45 - 0.2)
    assert nan["lost_steps"] == 0 and nan["reload_s"] == pytest.approx(0.05)


def test_nan_without_rerun_machinery_counts_as_a_restart(tmp_path: Path) -> None:
    # The goodput baseline: a NaN crashes the step; the other rank still logged a step after
    # the fault, and the relaunched processes re-enter 2 s later from the step-2 checkpoint.
    ev: list[dict[str, object]] = [{"ev": "start", "t": 0.0, "initial_rank": 0}]
    ev.append({"ev": "enter", "t": 0.1, "iteration": 0, "rank": 0})
    for step in range(3):
        ev.append({"ev": "step", "t": 0.2 + 0.1 * step, "step": step, "rank": 0, "seconds": 0.1})
    ev.append({"ev": "step", "t": 0.46, "step": 3, "rank": 1, "seconds": 0.1})
    ev.append({"ev": "enter", "t": 2.45, "iteration": 1, "rank": 0})
    ev.append({"ev": "restored", "t": 2.5, "iteration": 1, "rank": 0, "step": 2, "seconds": 0.05})
    ev.append({"ev": "done", "t": 2.6, "rank": 0, "step": 4, "loss": 1.0})
    _write(tmp_path, ev)
    faults = [{"fault": "nan@rank1:step3", "kind": "nan", "time": 0.45}]
    (nan,) = build_report(tmp_path, faults=faults, wall_end=2.7)["faults"]
    assert nan["recovered"] and nan["shutdown_restart_s"] == pytest.approx(2.0)
    assert nan["downtime_s"] > 2.0
