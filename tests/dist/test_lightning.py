"""Issue 19: PyTorch Lightning callbacks with a real ``Trainer(accelerator="cpu", devices=2,
strategy="ddp")`` on CPU/gloo: a SIGKILLed rank and the job resumes from the fastest surviving
tier to the clean run's final loss; a slowed rank is reported and the fit stops after a
checkpoint; ``fit()`` restarted in place, a warm reserve taking a SIGKILLed rank's place, to the
same final loss; Lightning's rank after a renumbering is the group's.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.multiproc import free_port, run_job, run_ranks, slow

SCRIPT = "tests/dist/workers_lightning.py"


@slow(
    "Lightning restarted in place: test_fit_restarts_in_place_and_a_reserve_takes_the_lost_"
    "ranks_place; an in-job restart resuming from a checkpoint: tests/dist/"
    "test_launcher_recovery.py::test_in_process_stop_leads_to_in_job_restart_that_resumes_from_"
    "the_checkpoint"
)
def test_sigkills_resume_from_the_local_tier_then_the_persistent_one_to_the_clean_loss(
    tmp_path: Path,
) -> None:
    # 12 steps (one per epoch); local save every step, persistent every 4. Rank 1 is SIGKILLed
    # at step 5 (both ranks' node-local copies survive) and again at step 9 after the
    # node-local directory was deleted (its copies are lost: the persistent step 8 remains).
    d = tmp_path
    kills = [{"rank": 1, "step": 5}, {"rank": 1, "step": 9, "wipe": True}]
    opts = {"dir": str(d), "epochs": 12, "kills": kills, "clean_port": free_port()}
    argv = [
        "-m",
        "restartable.launch",
        "--nproc-per-node",
        "2",
        "--monitor-interval",
        "0.05",
        "--stop-grace",
        "2",
        "--max-restarts",
        "2",
        SCRIPT,
        json.dumps(opts),
    ]
    job = run_job(argv, deadline=150.0)
    assert job.returncode == 0, job.output
    output = job.output
    results = {r: json.loads((d / f"result.{r}.json").read_text()) for r in (0, 1)}
    # Each kill fired once and the launcher restarted both ranks in place each time.
    assert "in-job restart 1/2" in output and "in-job restart 2/2" in output, output
    killed = {int((d / f"killed.{i}").read_text()) for i in (0, 1)}
    assert len(killed) == 2 and results[1]["pid"] not in killed, output
    # Where each launch came back from: the journal's restore records (every rank, per launch).
    journal = [
        json.loads(line)
        for f in (d / "ft" / "journal").glob("*.jsonl")
        for line in f.read_text().splitlines()
    ]
    restores = sorted((r["step"], r["tier"], r["rank"]) for r in journal if r["event"] == "restore")
    assert restores == [
        (5, "local_dir", 0),
        (5, "local_dir", 1),
        (8, "persistent", 0),
        (8, "persistent", 1),
    ], restores
    assert "names step 9; the newest step every rank can restore is 8" in output, output
    for rank, r in results.items():
        assert r["restore"] == [8, "persistent"], (rank, r["restore"])
        assert r["global_step"] == 12 == r["clean"]["global_step"], (rank, r)
        # The last launch ran only the steps after the restored one.
        assert [s for s, _ in r["losses"]] == list(range(8, 12)), (rank, r["losses"])
        # Same arithmetic as a run without faults: the same final loss and weights, exactly.
        assert r["final_loss"] == r["clean"]["final_loss"], (rank, r["final_loss"], r["clean"])
        assert r["params"] == r["clean"]["params"], rank
        clean = dict((s, loss) for s, loss in r["clean"]["losses"])
        assert all(clean[s] == loss for s, loss in r["losses"]), (rank, r["losses"], clean)
    # The fault-tolerance callback's files: the finished flag, learned timeouts, the journal.
    flag = json.loads((d / "ft" / "finished.flag").read_text())
    assert flag["finished"] is True and flag["global_step"] == 12, flag
    assert "checkpointing" in json.loads((d / "ft" / "ft_state.json").read_text())["timeouts"]
    events = {r["event"] for r in journal}
    assert {"step", "save", "restore", "fault"} <= events, sorted(events)


def test_fit_restarts_in_place_and_a_reserve_takes_the_lost_ranks_place(tmp_path: Path) -> None:
    # 3 processes for a Trainer(devices=2): the third is a warm reserve. Rank 1 is SIGKILLed at
    # step 5; the survivor re-enters fit() in its own process, the reserve becomes Lightning's
    # rank 1, both resume from step 5 (the reserve from the dead rank's node-local copy), with
    # no launcher restart (--max-restarts 0), to the clean run's final loss and weights.
    d = tmp_path
    opts = {
        "dir": str(d),
        "epochs": 12,
        "kills": [{"rank": 1, "step": 5}],
        "clean_port": free_port(),
        "config": {"active_world_size": 2},
    }
    argv = [
        "-m",
        "restartable.launch",
        "--nproc-per-node",
        "3",
        "--max-restarts",
        "0",
        SCRIPT,
        json.dumps(opts),
    ]
    job = run_job(argv, deadline=150.0)
    assert job.returncode == 0, job.output
    assert "in-job restart" not in job.output, job.output
    results = {r: json.loads((d / f"result.{r}.json").read_text()) for r in (0, 2)}
    assert int((d / "killed.0").read_text()) not in {r["pid"] for r in results.values()}
    assert results[0]["restore"] == [5, "memory"], results[0]
    assert results[2]["restore"] == [5, "local_dir"], results[2]
    assert [r["rank"] for r in results.values()] == [0, 1], results
    for launch_rank, r in results.items():
        assert [s for s, _ in r["losses"]] == list(range(5, 12)), (launch_rank, r["losses"])
        assert r["global_step"] == 12 == r["clean"]["global_step"], (launch_rank, r)
        assert r["final_loss"] == r["clean"]["final_loss"], (launch_rank, r, r["clean"])
        assert r["params"] == r["clean"]["params"], launch_rank


def test_straggler_callback_reports_the_slowed_rank_and_stops_after_a_checkpoint() -> None:
    outs = run_ranks(
        2,
        target="tests.dist.workers_lightning:straggler",
        kwargs={"slow_rank": 1, "steps": 600, "interval": 0.5},
        deadline=120.0,
    )
    for o in outs:
        r = o.result
        # The first report that names a straggler names rank 1 only, on both ranks alike.
        flagged = [s for s in r["stragglers"] if s]
        assert flagged and flagged[0] == [1], (o.rank, r)
        assert all(s == [1] for s in flagged), (o.rank, r)
        # stop_if_detected: a checkpoint (last.ckpt), then trainer.should_stop on every rank.
        assert r["stop"][-1] is True and r["stopped_fit"] is True, (o.rank, r)
        assert r["last_ckpt"] is True, (o.rank, r)
        assert r["global_step"] < 600, (o.rank, r)
    assert outs[0].result["global_step"] == outs[1].result["global_step"]


@slow("10-30 s, a reserve's set-up")
def test_after_a_renumbering_lightning_sees_the_groups_rank() -> None:
    # 2 active ranks + 1 warm reserve; rank 1 is SIGKILLed; the reserve (RANK 2) becomes group
    # rank 1. Lightning takes its rank from LOCAL_RANK/GROUP_RANK. Before the restart loop
    # wrote the iteration's values there (inprocess/restart/torchrun_env.py), it called that process
    # rank 2 of 2 and its DDP set-up failed (IndexError: device index 2 of 2); now it agrees
    # with the group, and the FT callback's guard has nothing to refuse.
    outs = run_ranks(
        3,
        target="tests.dist.workers_lightning:renumbered",
        host_store=True,
        deadline=120.0,
        expect_success=False,
    )
    by_rank = {o.rank: o for o in outs}
    assert by_rank[1].returncode == -9, by_rank[1].output
    reserve = by_rank[2].result
    assert reserve is not None, by_rank[2].output
    assert reserve["iteration"] == 1 and reserve["group_rank"] == 1, reserve
    assert (reserve["lightning_rank"], reserve["lightning_world"]) == (1, 2), reserve
    assert reserve["setup_error"] is None and reserve["guard"] is None, reserve
    survivor = by_rank[0].result
    assert survivor["group_rank"] == survivor["lightning_rank"] == 0, survivor
    assert survivor["guard"] is None and survivor["setup_error"] is None, survivor
