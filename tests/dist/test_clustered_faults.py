"""Issue 35: faults that cluster (kills a fraction of a second apart) and a reserve's death,
under the real launcher with CPU/gloo ranks (tests/dist/workers_launcher_recovery.py).

A decision short of ranks waits for the respawns the launcher announced instead of stopping
the job (``inprocess.protocol.capacity``); the death of a reserve never restarts the active
ranks. The four-kill case runs only with ``RESTARTABLE_SLOW_TESTS=1``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.dist.test_launcher_recovery import launch, results, steps
from tests.dist.workers_launcher_recovery import clean_loss
from tests.multiproc import slow

pytestmark = pytest.mark.timeout(150)


def _clustered(kills: int, steps_n: int) -> tuple[str, Path, int]:
    # 3 active + 1 reserve; ctx.rank 1 is SIGKILLed in iterations 0..kills-1 without waiting
    # for a refill: each kill comes a restart (~0.1-0.3 s) after the one before, while the
    # respawns started by the earlier kills are still starting (a cold start takes seconds).
    # The first kill waits until the reserve's warm-up ended: a reserve that takes a place
    # before waits for it (inprocess.restart.warmup), and that restart is no longer ~0.1 s.
    plan = [{"iteration": i, "rank": 1, "step": 2 + i, "after_warm": i == 0} for i in range(kills)]
    # respawn_wait_timeout 25 s (default 10): a cold start took over 10 s on this 2-core
    # machine at load 7 (the test checks the wait, not how fast a cold start is).
    config = {"active_world_size": 3, "min_active_world_size": 3, "respawn_wait_timeout": 25.0}
    # Each respawn starts 6 s late (a cold start): forked from the warm pool it was sometimes in
    # before the next decision (the restart by node's relay waits for a death report first), and
    # then no decision was short of ranks, and nothing here waited for a respawn.
    opts = {
        "steps": steps_n,
        "step_time": 0.05,
        "kills": plan,
        "config": config,
        "mark_warm": True,
        "respawn_start_delay": 6.0,
    }
    job, d = launch(4, opts, "--max-respawns", str(kills), "--max-restarts", "0", deadline=120)
    return job.output, d, job.returncode


def _check_finished_on_three(output: str, d: Path, kills: int, steps_n: int) -> None:
    fired = [json.loads(x) for x in (d / "kills.jsonl").read_text().splitlines()]
    assert [k["iteration"] for k in fired] == list(range(kills)), output
    assert "in-job restart" not in output and "not enough healthy ranks" not in output, output
    assert "waited" in output and "for respawned identities" in output, output
    done = results(d)
    assert {r["world_size"] for r in done.values()} == {3}, output
    assert all(r["total"] == clean_loss(steps_n, 3) for r in done.values()), done
    assert sorted(set(s["step"] for s in steps(d))) == list(range(steps_n))


def test_two_kills_in_a_row_wait_for_the_respawn_instead_of_stopping() -> None:
    # Before issue 35: the second decision counted 2 healthy ranks against
    # min_active_world_size=3 and stopped the job (status 75 with --max-restarts 0).
    output, d, rc = _clustered(2, 8)
    assert rc == 0, output
    _check_finished_on_three(output, d, 2, 8)
    # The respawns were forked from the node's warm pool (on by default with --max-respawns).
    assert "forked from the warm pool" in output, output
    assert not _orphaned_fork_servers()  # the pool's server ended with its launcher


@slow("four cold respawns; test_two_kills_in_a_row_wait_for_the_respawn... covers the wait")
def test_four_clustered_kills_finish_on_three_ranks_without_in_job_restart() -> None:
    output, d, rc = _clustered(4, 10)
    assert rc == 0, output
    _check_finished_on_three(output, d, 4, 10)


def test_a_reserves_death_does_not_interrupt_the_active_ranks() -> None:
    # 2 active + 1 reserve; the config's drill SIGKILLs the reserve (initial rank 2) 0.3-0.6 s
    # after the ranks met. Before issue 35 its watchdog ended the iteration: every active rank
    # restarted once. Now it is only marked gone; the launcher respawns its slot.
    drill = {
        "simulate_fault": True,
        "simulated_fault_type": "rank_killed",
        "simulated_fault_rank": 2,
        "simulated_fault_base_delay": 0.3,
    }
    opts = {"steps": 40, "step_time": 0.05, "config": {"active_world_size": 2, **drill}}
    job, d = launch(3, opts, "--max-respawns", "1")
    assert job.returncode == 0, job.output
    assert "rank 2 (identity 2) was killed by SIGKILL" in job.output, job.output
    assert {s["iteration"] for s in steps(d)} == {0}, job.output  # no restart at all
    done = results(d)
    assert set(done) == {0, 1}, done
    assert all(r["total"] == clean_loss(40, 2) for r in done.values()), done


def _orphaned_fork_servers() -> list[str]:
    """Command lines of warm-pool servers whose launcher is gone (a leak)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if "restartable.inprocess.forkserver" not in cmd:
            continue
        pid = next(int(a.split("=", 1)[1]) for a in cmd if a.startswith("--launcher-pid="))
        if not Path(f"/proc/{pid}").exists():
            found.append(" ".join(cmd))
    return found
