"""Any @restartable job run with a journal directory gets the downtime report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from restartable.inprocess import journal, report
from tests.multiproc import run_ranks


def test_report_of_a_job_that_is_not_the_example(tmp_path: Path) -> None:
    jdir = tmp_path / "journal"
    outs = run_ranks(
        2,
        target="tests.dist.workers_journal:job",
        kwargs={"root": str(tmp_path / "ckpt"), "record_dir": str(tmp_path / "faults")},
        host_store=True,
        deadline=60,
        env={journal.ENV_DIR: str(jdir)},
    )
    assert [o.result["value"] for o in outs] == [80, 80]
    (rep,) = report.reports(jdir)
    # The terms add up to the wall time by construction; the wall time is the job's own.
    assert rep.startup + rep.productive + rep.downtime == pytest.approx(rep.wall, abs=1e-9)
    measured = max(o.result["t_return"] for o in outs) - min(o.result["t_call"] for o in outs)
    assert abs(rep.wall - measured) <= 0.01 * measured, (rep.wall, measured)
    assert rep.restarts == 1 and len(rep.windows) == 1 and rep.steps == 39
    (w,) = rep.windows
    assert w.kind == "exception" and w.faulting_ranks == [1] and w.tier == "memory"
    # The fault's downtime is the gap in rank 0's progress, as rank 0 itself timed it.
    reached = outs[0].result["reached"]
    before = [t for t, s in reached if t <= w.sign]
    top = max(s for t, s in reached if t <= w.sign)
    again = min(t for t, s in reached if t > w.reentered and s >= top)
    assert w.terms["downtime"] == pytest.approx(again - before[-1], abs=0.005)
    terms = w.terms
    assert sum(v for k, v in terms.items() if k != "downtime") == pytest.approx(terms["downtime"])

    out = tmp_path / "report.json"
    cli = subprocess.run(
        [sys.executable, "-m", "restartable.inprocess.report", str(jdir), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cli.returncode == 0, cli.stderr
    assert "goodput" in cli.stdout and "downtime [s]" in cli.stdout
    assert json.loads(out.read_text())["launches"][0]["restarts"] == 1


def test_report_of_a_script_that_never_pings_nor_saves(tmp_path: Path) -> None:
    # The README calls ctx.ping optional: the report measures such a job from the progress
    # probe (no step numbers) instead of refusing it.
    jdir = tmp_path / "journal"
    outs = run_ranks(
        2,
        target="tests.dist.workers_journal:job",
        kwargs={
            "root": str(tmp_path / "ckpt"),
            "record_dir": str(tmp_path / "faults"),
            "ping": False,
            "step_s": 0.05,
        },
        host_store=True,
        deadline=60,
        env={journal.ENV_DIR: str(jdir)},
    )
    assert [o.result["value"] for o in outs] == [80, 80]  # 15 steps done, then 40 from 0
    (rep,) = report.reports(jdir)
    assert rep.progress_source == "probe" and rep.steps is None
    assert rep.startup + rep.productive + rep.downtime == pytest.approx(rep.wall, abs=1e-9)
    (w,) = rep.windows
    assert w.kind == "exception" and w.faulting_ranks == [1]
    # The probe records at most once a second: the window opens within that of the fault.
    assert 0 <= w.terms["lost_before"] <= 1.5 and w.back >= w.restored
    assert "steps unknown" in report.format_report(rep)
