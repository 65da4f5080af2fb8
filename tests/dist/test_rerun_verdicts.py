"""Every verdict end to end with 2 ranks on gloo: real exit codes, checkpoint files, relaunches."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from restartable.rerun import iterations_to_skip
from tests.multiproc import RankOutput, run_ranks

TARGET = "tests.dist.workers_rerun:train"
DEADLINE = 40.0


def launch(tmp: Path, **kw: Any) -> list[RankOutput]:
    return run_ranks(
        2,
        target=TARGET,
        kwargs={"outdir": str(tmp), **kw},
        deadline=DEADLINE,
        expect_success=False,
    )


def exits(tmp: Path) -> list[dict[str, Any]]:
    out = [json.loads((tmp / f"exit.{r}.json").read_text()) for r in range(2)]
    for r in range(2):
        (tmp / f"exit.{r}.json").unlink()
    return out


def codes(outs: list[RankOutput]) -> list[int | None]:
    return [o.returncode for o in outs]


def test_transient_error_on_rank1_exits_17_without_checkpoint(tmp_path: Path) -> None:
    outs = launch(tmp_path, inject="transient_error", inject_at=[[1, 3]])
    assert codes(outs) == [17, 17], outs[1].output
    ex = exits(tmp_path)
    assert [e["verdict"] for e in ex] == ["transient_error"] * 2
    assert [e["suspect_ranks"] for e in ex] == [[1], [1]]
    assert not (tmp_path / "ckpt.0.pt").exists()
    # Both ranks re-ran step 3 in place, then stopped.
    assert [p[0] for p in ex[0]["passes"]] == [1, 2, 3, 3]


def test_persistent_error_same_hardware_again_then_other_hardware(tmp_path: Path) -> None:
    outs = launch(tmp_path, inject="persistent_error", inject_at=[[1, 3]])
    assert codes(outs) == [16, 16], outs[1].output
    ex = exits(tmp_path)
    assert [e["action"] for e in ex] == [None, "demote"]
    assert ex[0]["checkpoint"] and ex[0]["suspect_hardware"] == ["host1-a"]
    saved = torch.load(tmp_path / "ckpt.1.pt", weights_only=False)["rerun"]
    assert saved["state"] == "will_rerun_elsewhere"

    # The scheduler put the job back on the same hardware: exit 16 again, checkpoint untouched.
    before = (tmp_path / "ckpt.1.pt").read_bytes()
    outs = launch(tmp_path, inject="persistent_error", inject_at=[[1, 3]], resume=True)
    assert codes(outs) == [16, 16], outs[1].output
    assert [e["checkpoint"] for e in exits(tmp_path)] == [False, False]
    assert (tmp_path / "ckpt.1.pt").read_bytes() == before

    # Other hardware: the result differs there, so the first hardware is at fault.
    outs = launch(
        tmp_path, inject="persistent_error", inject_at=[[1, 3]], resume=True, hardware="b"
    )
    assert codes(outs) == [17, 17], outs[1].output
    ex = exits(tmp_path)
    assert [e["verdict"] for e in ex] == ["persistent_error"] * 2
    assert ex[0]["suspect_hardware"] == ["host1-a"]
    assert [p[0] for p in ex[0]["passes"]] == [3]  # only the saved step ran again


def test_correct_result_reproduces_bit_identically_across_processes(tmp_path: Path) -> None:
    # Rejects rank 1's real loss at step 2: the in-place re-run and the re-run in a new process
    # on "other hardware" must both give exactly the same loss (RNG, data and weights replayed).
    outs = launch(tmp_path, forced_at=[[1, 2]])
    assert codes(outs) == [16, 16], outs[1].output
    first = exits(tmp_path)[1]["passes"]
    assert [p[0] for p in first] == [1, 2, 2]
    assert first[1][1] == first[2][1]

    outs = launch(tmp_path, forced_at=[[1, 2]], resume=True, hardware="b")
    assert codes(outs) == [17, 17], outs[1].output
    ex = exits(tmp_path)
    assert [e["verdict"] for e in ex] == ["correct_result"] * 2
    assert ex[1]["passes"] == [[2, first[1][1]]]
    assert iterations_to_skip(tmp_path / "rejected.jsonl") == [2]


def test_nan_on_one_rank_only(tmp_path: Path) -> None:
    outs = launch(tmp_path, nan_at=[[0, 4]])
    assert codes(outs) == [16, 16], outs[0].output
    ex = exits(tmp_path)
    # Rank 1's loss is finite, yet it re-ran the step too (same number of passes on both).
    assert [p[0] for p in ex[1]["passes"]] == [1, 2, 3, 4, 4]
    assert [e["action"] for e in ex] == ["demote", None]
    assert ex[1]["suspect_ranks"] == [0]


def test_spiky_loss_after_warmup_and_state_round_trip_across_a_restart(tmp_path: Path) -> None:
    # First launch: a spike inside the warm-up (3 losses) is not flagged; save after step 3.
    outs = launch(tmp_path, spiky=True, warmup=3, spike_at=[[0, 2]], steps=6, save_at=3)
    assert codes(outs) == [0, 0], outs[0].output
    assert [p[0] for p in outs[0].result["passes"]] == [1, 2, 3]
    saved = torch.load(tmp_path / "ckpt.0.pt", weights_only=False)["rerun"]
    assert saved["iteration"] == 3 and saved["state"] == "idle"
    # Second launch resumes at step 4 with the warm-up already done (restored from the state):
    # the spike at step 5 is flagged, re-run in place, and training continues.
    outs = launch(tmp_path, spiky=True, warmup=3, spike_at=[[1, 5]], steps=6, resume=True)
    assert codes(outs) == [0, 0], outs[0].output
    assert [p[0] for p in outs[0].result["passes"]] == [4, 5, 5, 6]
    lines = (tmp_path / "rejected.jsonl").read_text().splitlines()
    assert [json.loads(x)["message"] for x in lines] == ["Spiky loss"] * 2
    assert [json.loads(x)["rank"] for x in lines] == [1, 1]


def test_in_job_exit_demotes_the_suspect_and_the_other_rank_waits_for_it(tmp_path: Path) -> None:
    # Without a wrapper: the suspect (rank 1) raises RerunExit("demote") at once and dies; rank 0
    # waits in the group until that teardown, then raises RerunExit(None).
    outs = launch(tmp_path, inject="persistent_error", inject_at=[[1, 3]], in_job=True)
    assert codes(outs) == [1, 1]
    ex = exits(tmp_path)
    assert [e["action"] for e in ex] == [None, "demote"]
    assert all(e["raised"] and e["code"] == 16 for e in ex)
    assert ex[0]["raised_at"] >= ex[1]["raised_at"]
    assert "RerunExit" in outs[1].output
