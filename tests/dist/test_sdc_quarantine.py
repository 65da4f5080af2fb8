"""Checkpoints written between a silent data corruption and its finding are quarantined on every
tier and never restored: not by the restart after the finding, not after a later fault, not by a
requeued job resuming from the same directories (real ranks over gloo; tests/multiproc.py).

The job (tests/dist/workers_quarantine.py) corrupts rank 1's gradients from step 40 on, commits
persistent steps 42 and 44 from the corrupt trajectory (46 is in flight), and learns at step 46
that everything after step 40 is distrusted. A job that resumed from any of them would end with
another loss than the clean run's; the quarantined files stay on disk, named in the log.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.multiproc import run_ranks

W = "tests.dist.workers_quarantine"
STEPS = 50


def _run(tmp: Path, then: str, **kw: Any) -> list[Any]:
    kwargs = {"root": str(tmp / "ckpt"), "local_dir": str(tmp / "local"), "steps": STEPS}
    return run_ranks(2, target=f"{W}:run", kwargs={**kwargs, "then": then, **kw}, deadline=120)


@pytest.fixture(scope="module")
def clean_loss(tmp_path_factory: pytest.TempPathFactory) -> float:
    out = _run(tmp_path_factory.mktemp("clean"), "restart")
    assert out[0].result["loss"] == out[1].result["loss"]
    return float(out[0].result["loss"])


def _corrupt_loss(tmp: Path) -> float:
    """The same job, corrupt from step 40 and never told: what a resume onto it would give."""
    out = _run(tmp, "restart", corrupt_from=40)
    return float(out[0].result["loss"])


def _steps(names: list[str]) -> list[int]:
    return [int(n[5:15]) for n in names]


def _in_flight_46_refused_or_quarantined(steps: list[str], output: str) -> None:
    """Step 46's save was in flight at the finding: it never committed, or it is quarantined."""
    if 46 not in _steps(steps):
        assert "step 46 not committed: a finding of silent data corruption" in output, output


def _quarantined(root: Path) -> tuple[dict[str, Any], list[str]]:
    (where,) = (root / "quarantine").iterdir()
    record = json.loads((where / "finding.json").read_text())
    steps = sorted(p.name for p in where.iterdir() if p.name.startswith("step_"))
    for name in steps:  # whole checkpoints, evidence: their commit markers intact
        assert (where / name / "_COMMITTED.json").is_file(), name
    return record, steps


def _names_each(output: str, steps: list[str], root: Path) -> None:
    (where,) = (root / "quarantine").iterdir()
    for name in steps:
        step = int(name.split("_")[1].split("-")[0])
        line = f"quarantined step {step} of the persistent tier: {where / name}"
        assert line in output, output[-3000:]


def test_restart_and_a_later_fault_resume_from_the_verified_step(
    tmp_path: Path, clean_loss: float
) -> None:
    assert _corrupt_loss(tmp_path / "corrupt") != clean_loss  # the corruption changes the loss
    out = _run(tmp_path, "restart", corrupt_from=40, found_at=46, trusted=40)
    for o in out:
        # first load: none (a fresh job); the restart after the finding, then the later fault:
        # the verified step 40 both times, never 42-46 (persistent) or 45, 46 (local tier).
        assert o.result["loads"] == [None, 40, 40], o.output[-3000:]
        assert o.result["loss"] == clean_loss
    root = tmp_path / "ckpt"
    record, steps = _quarantined(root)
    assert _steps(steps)[:2] == [42, 44], steps
    _in_flight_46_refused_or_quarantined(steps, out[0].output)
    assert record["applied"] is True and record["after"] == 40
    assert record["finding"]["step"] == 40 and record["finding"]["detected_at"] == 46
    _names_each(out[0].output, steps, root)
    # The node-local files (steps 45, 46), moved whole, and the memory copies, forgotten.
    assert list((tmp_path / "local" / "quarantine").glob("*/shard-*.bin"))
    for o in out:
        assert "quarantined step 46 of the local_dir tier" in o.output, o.output[-3000:]
        assert "quarantined step 46 of the memory tier" in o.output, o.output[-3000:]
    # The re-trained steps 42-46 were new checkpoints of their own; 46-50 are kept now.
    assert sorted(_steps([p.name for p in root.glob("step_*")])) == [46, 48, 50]


def test_a_requeued_job_never_resumes_a_quarantined_step(tmp_path: Path, clean_loss: float) -> None:
    first = _run(tmp_path, "crash", corrupt_from=40, found_at=46, trusted=40)
    assert [o.result["step"] for o in first] == [46, 46]
    root = tmp_path / "ckpt"
    # Recorded, not yet applied: the job died before its restart's load.
    (where,) = (root / "quarantine").iterdir()
    assert json.loads((where / "finding.json").read_text())["applied"] is False
    out = _run(tmp_path, "resume")
    for o in out:
        assert o.result["loads"] == [40], o.output[-3000:]
        assert o.result["loss"] == clean_loss
    record, steps = _quarantined(root)
    assert _steps(steps)[:2] == [42, 44] and record["applied"] is True, steps
    _in_flight_46_refused_or_quarantined(steps, first[0].output)
    _names_each(out[0].output, steps, root)
    # The first job's node-local files (processes now gone) are moved by the second's ranks.
    assert list((tmp_path / "local" / "quarantine").glob("*/shard-*.bin"))
