"""The report of any job: progress from saves or the probe when train() never pings, --png
without matplotlib, a NaN seen first on another rank, and a requeued job's attempts."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from restartable.inprocess import report
from restartable.inprocess.report import cli, downtime, job_view, terms


def _job(event: str, *, launch: str = "L", t0: float = 0.0) -> list[dict[str, Any]]:
    """One launch with a fault at 2.05: progress recorded as ``event`` records of rank 0
    ("step", "save" or the probe's "progress"), every 0.1 s, around it."""

    def points(start: float, first: int, n: int, it: int) -> list[dict[str, Any]]:
        return [
            {"t": t0 + start + i * 0.1, "event": event, "training_rank": 0, "iteration": it,
             **({} if event == "progress" else {"step": first + i})}
            for i in range(n)
        ]  # fmt: skip

    recs: list[dict[str, Any]] = [{"t": t0, "event": "job_start"}]
    recs += points(1.0, 0, 11, 0)  # 0..10 at 1.0 .. 2.0
    recs += [
        {"t": t0 + 2.05, "event": "fault", "iteration": 0, "kind": "exception", "fault_rank": 1},
        {"t": t0 + 2.2, "event": "iteration_start", "iteration": 1},
        {"t": t0 + 2.3, "event": "restart", "iteration": 1, "cause": "exception on rank 1",
         "faulting_ranks": [1], "active_before": [0, 1], "phases": {}},
        {"t": t0 + 2.4, "event": "restore", "iteration": 1, "training_rank": 0, "tier": "memory",
         "step": 8},
    ]  # fmt: skip
    recs += points(2.5, 8, 13, 1)  # 8..20 at 2.5 .. 3.7; 10 again at 2.7
    recs += [{"t": t0 + 4.0, "event": "job_end"}]
    for r in recs:
        r["launch"] = launch
    return sorted(recs, key=lambda r: r["t"])


def _adds_up(r: terms.LaunchReport) -> None:
    assert r.startup + r.productive + r.downtime == pytest.approx(r.wall)
    for w in r.windows:
        t = w.terms
        parts = ("lost_before", "detection", "restart", "reload", "redo")
        assert sum(t[k] for k in parts) == pytest.approx(t["downtime"])
        assert all(t[k] >= 0 for k in parts), t


def test_a_script_without_ping_is_reported_from_its_checkpoint_saves() -> None:
    r = downtime.build(_job("save"))
    assert r.progress_source == "saves" and r.steps == 20
    (w,) = r.windows
    assert (w.reached_step, w.restored_step) == (10, 8)
    assert w.terms["redo"] == pytest.approx(0.3)  # saves 8, 9 again; 10 at 2.7
    _adds_up(r)
    assert "highest step saved 20 (no ctx.ping" in report.format_report(r)


def test_a_script_without_ping_or_saves_is_reported_from_the_progress_probe() -> None:
    r = downtime.build(_job("progress"))
    assert r.progress_source == "probe" and r.steps is None
    (w,) = r.windows
    assert w.last == pytest.approx(2.0) and w.back == pytest.approx(2.5)  # first sign after
    _adds_up(r)
    text = report.format_report(r)
    assert "steps unknown" in text and "progress probe" in text


def test_a_nan_seen_first_on_rank_1_is_back_at_the_restored_step() -> None:
    # Rank 1 fired its NaN at step 200 before rank 0 pinged 200; the restart restored step 200.
    recs: list[dict[str, Any]] = [{"t": 0.0, "event": "job_start"}]
    recs += [{"t": 1.0 + i * 0.1, "event": "step", "step": 190 + i, "training_rank": 0,
              "iteration": 3} for i in range(10)]  # 190..199 at 1.0 .. 1.9  # fmt: skip
    recs += [
        {"t": 1.95, "event": "fault_fired", "iteration": 3, "kind": "nan",
         "fault": "nan@rank1:step200"},
        {"t": 2.1, "event": "fault", "iteration": 3, "kind": "exception", "fault_rank": 3},
        {"t": 2.2, "event": "iteration_start", "iteration": 4},
        {"t": 2.3, "event": "restart", "iteration": 4, "cause": "exception on rank 3",
         "faulting_ranks": [3], "active_before": [0, 3, 2], "phases": {}},
        {"t": 2.4, "event": "restore", "iteration": 4, "training_rank": 0, "tier": "memory",
         "step": 200},
        {"t": 2.5, "event": "step", "step": 200, "training_rank": 0, "iteration": 4},
        {"t": 3.0, "event": "job_end"},
    ]  # fmt: skip
    r = downtime.build(recs)
    (w,) = r.windows
    assert (w.restored_step, w.reached_step) == (200, 200)  # not "back at step 199"
    assert w.back == pytest.approx(2.5) and w.training_ranks == [1]
    _adds_up(r)
    (row,) = [x for x in report.format_report(r).splitlines() if "nan@rank1" in x]
    # tier, from step, back at step, restored from (these records do not name the ranks)
    assert row.split()[-4:] == ["memory", "200", "200", "-"]
    assert row.split()[4:6] == ["1", "3"]  # rank 1 as the plan says, initial rank 3


def _write(directory: Path, records: list[dict[str, Any]]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "rank0-host-1.jsonl").write_text(
        "".join(json.dumps({"v": 1, **r}) + "\n" for r in records)
    )


def test_png_without_matplotlib_names_the_extra_and_still_writes_the_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _write(tmp_path / "j", _job("step"))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    out = tmp_path / "report.json"
    status = cli.main([str(tmp_path / "j"), "--json", str(out), "--png", str(tmp_path / "p")])
    assert status == cli.EXIT_NO_PLOT
    assert json.loads(out.read_text())["launches"][0]["steps"] == 20
    assert not (tmp_path / "p").exists()
    err = capsys.readouterr().err
    assert "pip install 'restartable[plot]'" in err and str(out) in err


def test_a_requeued_job_gets_a_report_per_attempt_and_a_job_view(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = _job("step", launch="attempt-0")
    # The second attempt starts 6 s after the first ended, from a checkpoint of step 15: it
    # redoes 15..20 (0.5 s) before it is back where the first attempt stopped.
    second = [r for r in _job("step", launch="attempt-1", t0=10.0) if r["event"] in
              ("job_start", "job_end")]  # fmt: skip
    second += [{"t": 11.0 + i * 0.1, "event": "step", "step": 15 + i, "training_rank": 0,
                "iteration": 0, "launch": "attempt-1"} for i in range(21)]  # fmt: skip
    _write(tmp_path / "j", sorted(first + second, key=lambda r: r["t"]))
    out = tmp_path / "report.json"
    assert cli.main([str(tmp_path / "j"), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "launch attempt-0:" in text and "launch attempt-1:" in text
    assert "job over 2 attempts" in text and "requeue gap" in text
    doc = json.loads(out.read_text())
    assert [a["launch"] for a in doc["launches"]] == ["attempt-0", "attempt-1"]
    (gap,) = doc["job"]["gaps"]
    assert gap["gap_s"] == pytest.approx(6.0) and gap["redo_s"] == pytest.approx(0.5)
    assert gap["redo_to_step"] == 20
    job = doc["job"]
    assert job["wall_s"] == pytest.approx(14.0)
    assert job["startup_s"] + job["productive_s"] + job["downtime_s"] == pytest.approx(14.0)
    assert job["requeue_downtime_s"] == pytest.approx(6.5)
    attempts = doc["launches"]
    assert job["downtime_s"] == pytest.approx(sum(a["downtime_s"] for a in attempts) + 6.5)


def test_the_job_view_of_one_attempt_has_no_gap() -> None:
    view = job_view.build([downtime.build(_job("step"))])
    assert view.gaps == [] and view.wall == pytest.approx(4.0)
    assert view.startup + view.productive + view.downtime == pytest.approx(view.wall)
