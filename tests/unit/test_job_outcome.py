"""Issue 49: the job's end is recorded once, next to the autoresume flag, for every node and a
killed launcher's stand-in to read without node 0's store (inprocess.launch.outcome), and the
stand-in gives up on a store that is gone within --node-timeout, never 2 x 30 s."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from restartable.inprocess.clock import SYSTEM
from restartable.inprocess.launch.outcome import JobOutcome
from restartable.inprocess.srun_task.stand_in import launcher_job_status
from tests.fake_clock import FakeClock
from tests.multiproc import free_ports


def test_first_launcher_to_end_wins_for_every_node(tmp_path: Path) -> None:
    flag = str(tmp_path / "autoresume.json")
    node0, node1 = JobOutcome(flag, "slurm-7-0"), JobOutcome(flag, "slurm-7-0")
    assert node1.read() is None
    assert node0.record(0, "the job finished") == (0, "the job finished")
    # node 1 found the store gone a moment later: it ends as the job did, not with 75
    assert node1.record(75, "the control store is gone") == (0, "the job finished")
    assert node1.read() == (0, "the job finished")


def test_a_requeued_attempt_never_reads_an_earlier_record(tmp_path: Path) -> None:
    flag = str(tmp_path / "autoresume.json")
    JobOutcome(flag, "slurm-7-0").record(75, "preempted")
    later = JobOutcome(flag, "slurm-7-1")
    assert later.read() is None
    assert later.record(0, "the job finished") == (0, "the job finished")
    assert [p.name for p in tmp_path.iterdir()] == ["autoresume.json.end-slurm-7-1"]


def test_without_a_flag_file_nothing_is_recorded(tmp_path: Path) -> None:
    assert JobOutcome(None, "slurm-7-0").record(75, "x") == (75, "x")
    assert JobOutcome(None, "slurm-7-0").read() is None


def _argv(flag: Path, port: int, node_timeout: float = 20.0, node: int = 1) -> list[str]:
    where = ["--master-addr", "127.0.0.1", "--master-port", str(port)]
    return [
        *("--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1", *where),
        *("--node-timeout", str(node_timeout), "--autoresume-file", str(flag), "train.py"),
    ]


def test_stand_in_reads_the_record_when_node_0_is_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: the stand-in connected first (30 s timeout, twice) to the store that node 0's
    # launcher took with it, and the job ended FAILED 137:0 though it had finished.
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    flag = tmp_path / "autoresume.json"
    JobOutcome(str(flag), "slurm-7-0").record(0, "the job finished")
    t0 = time.monotonic()
    assert launcher_job_status(_argv(flag, free_ports(1)[0]), 60.0, SYSTEM) == 0
    assert time.monotonic() - t0 < 2.0


def test_stand_in_gives_up_within_node_timeout_without_evidence(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("RESTARTABLE_SECRET", "ab" * 32)  # no secret file needed
    port = free_ports(1)[0]  # nobody listens: each try gives up after its own 3 s
    t0 = time.monotonic()
    assert launcher_job_status(_argv(tmp_path / "f.json", port, 2.0), 3600.0, SYSTEM) is None
    # --node-timeout 2 (+ torch's import and a 3 s try or two), not 2 x 30 s nor 3600 s
    assert time.monotonic() - t0 < 30.0


def test_node_0_stand_in_waits_for_the_record_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Node 0's launcher hosted the control store: its stand-in tried to connect to it (2 x 30 s
    # before; then 3 s tries with a C++ stack dump each), when only node 1's record can answer.
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    fake = FakeClock()
    flag, port = tmp_path / "autoresume.json", free_ports(1)[0]
    t0 = time.monotonic()
    assert launcher_job_status(_argv(flag, port, 20.0, node=0), 3600.0, fake.clock()) is None
    assert 20.0 < fake.now - 1000.0 < 21.0 and time.monotonic() - t0 < 5.0  # no connection try
    JobOutcome(str(flag), "slurm-7-0").record(75, "the control store is gone")
    assert launcher_job_status(_argv(flag, port, 20.0, node=0), 3600.0, fake.clock()) == 75
