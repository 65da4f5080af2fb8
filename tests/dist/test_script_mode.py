"""Unmodified torchrun scripts under ``inprocess.launch``: re-run in place after a fault.

Two third-party shapes (tests/dist/torchrun_scripts/): pytorch/examples' DDP tutorial
(``main()`` under ``if __name__ == "__main__"``, snapshot.pt) and nanoGPT's train.py
(module-level code, ckpt.pt). Each fault (exception, hang, SIGKILL with a reserve) must end
with exit 0, the surviving ranks in the same processes, and every rank resuming from the
script's own file.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import pytest

from tests.multiproc import REPO_ROOT, run_job, slow, startup_s

SCRIPTS = REPO_ROOT / "tests" / "dist" / "torchrun_scripts"
FAST = {"soft_timeout": 3.0, "hard_timeout": 8.0, "heartbeat_interval": 0.5}
# The form's command line and the line it prints when it resumes from its own file.
FORMS = {
    # {saved}: the epoch of rank 0's last snapshot before the restart (the fault on rank 1 may
    # interrupt rank 0 before or after its save of the epoch in flight).
    "main": (
        ["multigpu_torchrun.py", "4", "1"],
        "Resuming training from snapshot at Epoch {saved}",
    ),
    "module": (["nanogpt_train.py", "--max_iters=12"], "Resuming training from out"),
}


def _fault_args(form: str, kind: str, rank: int) -> list[str]:
    if form == "main":
        return ["--fault", kind, "--fault_epoch", "2", "--fault_rank", str(rank)]
    return [f"--fault={kind}", "--fault_iter=6", f"--fault_rank={rank}"]


def _run(
    tmp_path: Path, form: str, kind: str, *, nproc: int, fault_rank: int, respawns: int = 0
) -> str:
    """Run the form's script with one fault from ``tmp_path`` (its files land there)."""
    argv, _ = FORMS[form]
    config = {**FAST, "active_world_size": 2}
    job = run_job(
        [
            "-m",
            "restartable.launch",
            "--nproc-per-node",
            str(nproc),
            "--max-respawns",
            str(respawns),
            str(SCRIPTS / argv[0]),
            *argv[1:],
            *_fault_args(form, kind, fault_rank),
        ],
        # The ranks' start-ups (one at a time on 2 cores), the fault's detection and a run.
        deadline=nproc * startup_s() + 60,
        env={"INPROCESS_RESTART_CONFIG": json.dumps(config)},
        cwd=tmp_path,
    )
    assert job.returncode == 0, job.output
    return job.output


def _starts(output: str) -> dict[str, list[tuple[int, str, str]]]:
    """Per launcher slot: (pid, RANK, restart count) of each run of the script."""
    starts: dict[str, list[tuple[int, str, str]]] = defaultdict(list)
    for slot, pid, rank, count in re.findall(
        r"^\[rank (\d+)\] start pid (\d+) RANK (\d+) (?:TORCHELASTIC_RESTART_COUNT|restart) (\d+)",
        output,
        re.MULTILINE,
    ):
        starts[slot].append((int(pid), rank, count))
    return starts


def _assert_restarted_in_place(output: str, form: str, slots: tuple[str, ...]) -> None:
    """Every slot in ``slots`` ran the script twice in one process, the second time as
    restart 1, resumed from the script's own file and finished."""
    starts = _starts(output)
    before = output.split("Loading snapshot", 1)[0]
    saved = re.findall(r"^\[rank 0\] Epoch (\d+) \| Training snapshot saved", before, re.MULTILINE)
    resumed = FORMS[form][1].format(saved=saved[-1] if saved else "(none saved)")
    for slot in slots:
        runs = starts[slot]
        assert len(runs) == 2, (slot, runs, output)
        assert runs[0][0] == runs[1][0], f"slot {slot} changed process: {runs}\n{output}"
        assert [r[2] for r in runs] == ["0", "1"], (runs, output)
        assert f"[rank {slot}] {resumed}" in output, output
        assert re.search(rf"^\[rank {slot}\] done RANK \d", output, re.MULTILINE), output


def test_tutorial_script_is_rerun_in_place_after_an_exception(tmp_path: Path) -> None:
    output = _run(tmp_path, "main", "raise", nproc=2, fault_rank=1)
    _assert_restarted_in_place(output, "main", ("0", "1"))
    assert "RuntimeError: injected fault at step 2" in output, output
    assert (tmp_path / "snapshot.pt").exists()


def test_tutorial_script_is_rerun_in_place_after_a_hang(tmp_path: Path) -> None:
    output = _run(tmp_path, "main", "hang", nproc=2, fault_rank=1)
    _assert_restarted_in_place(output, "main", ("0", "1"))
    assert "soft timeout: no progress of the main thread" in output, output


def test_module_level_script_survives_a_sigkill_with_a_reserve(tmp_path: Path) -> None:
    # RANK 1 (slot 1) is killed; the reserve (slot 2) runs the script from the top as RANK 1.
    output = _run(tmp_path, "module", "kill", nproc=3, fault_rank=1)
    _assert_restarted_in_place(output, "module", ("0",))
    starts = _starts(output)
    assert [(r, c) for _, r, c in starts["2"]] == [("1", "1")], (starts, output)
    assert "[rank 2] Resuming training from out" in output, output
    assert "[rank 2] done RANK 1" in output, output
    assert "[rank 1] done" not in output, output


@slow("three more fault runs of ~15-25 s each; the three tests above cover each fault once")
@pytest.mark.parametrize(
    ("form", "kind", "nproc", "fault_rank"),
    [("module", "raise", 2, 1), ("module", "hang", 2, 0), ("main", "kill", 3, 0)],
)
def test_other_forms_and_faults(
    tmp_path: Path, form: str, kind: str, nproc: int, fault_rank: int
) -> None:
    output = _run(tmp_path, form, kind, nproc=nproc, fault_rank=fault_rank)
    survivors = ("0", "1") if kind != "kill" else ("1",)
    _assert_restarted_in_place(output, form, survivors)
    if kind == "kill":
        assert [(r, c) for _, r, c in _starts(output)["2"]] == [("0", "1")], output


@slow("a SIGKILL and a respawn (~25 s); the reserve's takeover above covers the same re-run")
def test_a_respawned_rank_runs_the_script_from_the_top_as_the_lost_rank(tmp_path: Path) -> None:
    # No reserve: the launcher respawns the slot (from the warm pool), the new process joins
    # and runs the module-level script as RANK 1, resuming from ckpt.pt.
    output = _run(tmp_path, "module", "kill", nproc=2, fault_rank=1, respawns=1)
    _assert_restarted_in_place(output, "module", ("0",))
    assert re.search(r"^\[rank 1\.1\] start pid \d+ RANK 1 restart 1$", output, re.M), output
    assert "[rank 1.1] Resuming training from out" in output, output
    assert "[rank 1.1] done RANK 1" in output, output
