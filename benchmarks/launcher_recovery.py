"""Process-level recovery costs of ``python -m restartable.launch`` (CPU, gloo, localhost).

In one invocation, with the rank script of the launcher tests
(``tests/dist/workers_launcher_recovery.py``: an all_reduce loop that checkpoints every step to
a small JSON file and resumes from it on every start):

* ``refill``: 3 active ranks + 1 reserve under ``--max-respawns 1``; ctx.rank 1 SIGKILLs itself
  (``refill_cold``: the same with ``--no-warm-pool``, the respawn a cold start).
  Measured from the kill to the respawned process being a ready reserve (registered in the
  store, watchdog running: its journal's ``reserve_ready`` record); the
  in-process restart that the reserve made meanwhile is reported next to it.
* ``recovery`` of the same 2-rank job after rank 1 raises at step 3, from the raise to the
  first step finished after it, less one step time (no work is lost: a checkpoint per step):
  ``in_process`` (``@restartable`` restarts train() in place), ``in_job`` (``max_iterations=1``
  makes the in-process path give up; ``--max-restarts 1`` restarts every process, forked from
  the warm pool; ``in_job_cold``: the same with ``--no-warm-pool``), and
  ``torchrun`` (the same loop without ``@restartable`` under ``torchrun --max-restarts 1``,
  the baseline). Ratios are against torchrun, measured in the same run, trials interleaved.
  ``cold_start_s``: launch -> first step of the same runs (an in-job restart is a cold start
  of every process, plus noticing that the in-process path stopped).
* ``clustered``: 3 active + 1 reserve, ``--max-respawns 4 --max-restarts 0``, ctx.rank 1
  SIGKILLed in iterations 0..3 (each kill one in-process restart after the one before: 0.2-1 s
  apart): whether the job finished on 3 ranks without an in-job restart, the gaps between the
  kills, and the downtime per fault (kill -> the next step finished, less one step time);
  decisions short of ranks wait for the respawns on their way (issue 35).
* ``watchdog``: one watchdog process (``inprocess.watchdog_owner.Watchdog``) against a real
  TCPStore: start -> ready (wall and CPU seconds), resident memory, whether torch is mapped.

Targets (issue 35; same run): ``refill.median_kill_to_ready_reserve_s`` <= 0.5,
``ratio_vs_torchrun.in_job`` <= 0.5, ``clustered.finished`` true with no in-job restart,
``watchdog.rss_mb`` <= 30 and ``watchdog.start_s`` <= 0.05. ``loadavg`` is the 1-minute load
before and after the run: figures taken above 2.5 on a 2-core host are not comparable.

    python benchmarks/launcher_recovery.py              # 3 trials each
    python benchmarks/launcher_recovery.py --trials 1
    python benchmarks/launcher_recovery.py --only watchdog,clustered
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "tests/dist/workers_launcher_recovery.py")
STEP_S = 0.05  # synthetic step time
CONFIG = {
    "soft_timeout": 20.0,
    "hard_timeout": 30.0,
    "heartbeat_interval": 0.1,
    "barrier_timeout": 30.0,
    "completion_timeout": 30.0,
    "termination_grace_time": 0.5,
}
LAUNCH = ["-m", "restartable.launch", "--monitor-interval", "0.02", "--stop-grace", "2"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}


def _run(cmd: list[str], timeout: float = 180.0) -> str:
    p = subprocess.run(
        [sys.executable, *cmd], cwd=ROOT, env=_env(), capture_output=True, timeout=timeout
    )
    out = p.stdout.decode(errors="replace") + p.stderr.decode(errors="replace")
    if p.returncode != 0:
        raise RuntimeError(f"{cmd[:3]} exited {p.returncode}:\n{out[-4000:]}")
    return out


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def refill_once(warm: bool = True) -> dict[str, float]:
    """Kill -> respawned process registered as a ready reserve (seconds), from the journal's
    ``reserve_ready`` record; ``warm``: forked from the warm pool (else ``--no-warm-pool``)."""
    from restartable.inprocess import journal

    d = Path(tempfile.mkdtemp(prefix="bench-refill-"))
    opts = {
        "dir": str(d),
        "steps": 60,
        "step_time": STEP_S,
        "kills": [{"iteration": 0, "rank": 1, "step": 3}],
        "config": {**CONFIG, "active_world_size": 3, "journal_dir": str(d / "journal")},
    }
    cmd = [*LAUNCH, "--nproc-per-node", "4", "--max-respawns", "1",
           *([] if warm else ["--no-warm-pool"]), SCRIPT, json.dumps(opts)]  # fmt: skip
    out = _run(cmd, timeout=300)
    ready = [r["t"] for r in journal.read(d / "journal") if r["event"] == "reserve_ready"]
    if not ready:
        raise RuntimeError(f"no respawned process became ready:\n{out[-4000:]}")
    killed = _lines(d / "kills.jsonl")[0]["time"]
    restart = next(r for r in journal.read(d / "journal") if r["event"] == "restart")
    return {
        "kill_to_ready_reserve_s": min(ready) - killed,
        "in_process_restart_s": sum(restart["phases"].values()),
    }


def recovery_once(mode: str) -> tuple[float, float]:
    """(raise at step 3 -> first step finished after it, less one step; launch -> first step
    finished, the job's cold start for comparison), in seconds."""
    d = Path(tempfile.mkdtemp(prefix=f"bench-{mode}-"))
    opts: dict[str, Any] = {"dir": str(d), "steps": 6, "step_time": STEP_S, "ckpt_every": 1,
                            "raise_at": {"step": 3, "rank": 1, "once": True},
                            "config": dict(CONFIG)}  # fmt: skip
    if mode == "in_process":
        cmd = [*LAUNCH, "--nproc-per-node", "2", SCRIPT, json.dumps(opts)]
    elif mode in ("in_job", "in_job_cold"):
        opts["config"]["max_iterations"] = 1
        cold = ["--no-warm-pool"] if mode == "in_job_cold" else []
        cmd = [*LAUNCH, "--nproc-per-node", "2", "--max-restarts", "1", *cold, SCRIPT,
               json.dumps(opts)]  # fmt: skip
    else:
        opts["plain"] = True
        cmd = ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
               "--monitor-interval", "0.02", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}",
               SCRIPT, json.dumps(opts)]  # fmt: skip
    launched = time.time()
    _run(cmd)
    raised = float((d / "raised").read_text())
    done = _lines(d / "steps.jsonl")
    after = min(s["time"] for s in done if s["time"] > raised)
    return after - raised - STEP_S, done[0]["time"] - launched


def watchdog_once() -> dict[str, Any]:
    """One watchdog process: start -> ready (wall, and its CPU seconds), RSS, torch mapped."""
    import datetime

    from torch.distributed import TCPStore

    from restartable.inprocess.watchdog_owner import Watchdog

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=30))  # fmt: skip
    w = Watchdog(store_host="127.0.0.1", store_port=server.port, initial_rank=0,
                 hard_timeout=30.0, termination_grace_time=1.0, heartbeat_interval=1.0,
                 logdir=None)  # fmt: skip
    t0 = time.monotonic()
    w.start()
    start_s = time.monotonic() - t0
    proc = Path(f"/proc/{w.pid}")
    rss_kb = next(
        int(x.split()[1]) for x in (proc / "status").read_text().splitlines() if "VmRSS" in x
    )
    fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
    cpu_s = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
    torch_mapped = "libtorch" in (proc / "maps").read_text()
    w.close()
    return {"start_s": start_s, "cpu_s": cpu_s, "rss_mb": rss_kb / 1024, "torch": torch_mapped}


def clustered_once() -> dict[str, Any]:
    """Four kills one in-process restart apart; downtime per fault (see the module doc)."""
    d = Path(tempfile.mkdtemp(prefix="bench-clustered-"))
    kills = [{"iteration": i, "rank": 1, "step": 2 + i} for i in range(4)]
    config = {**CONFIG, "active_world_size": 3, "min_active_world_size": 3,
              "respawn_wait_timeout": 25.0}  # fmt: skip
    opts = {"dir": str(d), "steps": 12, "step_time": STEP_S, "kills": kills, "config": config}
    cmd = [*LAUNCH, "--nproc-per-node", "4", "--max-respawns", "4", "--max-restarts", "0",
           SCRIPT, json.dumps(opts)]  # fmt: skip
    p = subprocess.run([sys.executable, *cmd], cwd=ROOT, env=_env(), capture_output=True,
                       timeout=300)  # fmt: skip
    out = p.stdout.decode(errors="replace") + p.stderr.decode(errors="replace")
    fired = [k["time"] for k in _lines(d / "kills.jsonl")] if (d / "kills.jsonl").exists() else []
    steps = sorted(s["time"] for s in _lines(d / "steps.jsonl"))
    downtime = [min((t for t in steps if t > k), default=float("nan")) - k - STEP_S for k in fired]
    return {
        "status": p.returncode,
        "finished": p.returncode == 0 and "in-job restart" not in out,
        "kills": len(fired),
        "gaps_between_kills_s": [b - a for a, b in itertools.pairwise(fired)],
        "downtime_per_fault_s": downtime,
        "decisions_that_waited": out.count("for respawned identities"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--only", default="refill,recovery,clustered,watchdog",
                   help="comma-separated parts to run (default: all)")  # fmt: skip
    args = p.parse_args()
    parts = set(args.only.split(","))
    report: dict[str, Any] = {"trials": args.trials, "loadavg_before": os.getloadavg()[0]}
    if "watchdog" in parts:
        wd = [watchdog_once() for _ in range(max(args.trials, 5))]
        report["watchdog"] = {
            "start_s": [w["start_s"] for w in wd],
            "median_start_s": statistics.median(w["start_s"] for w in wd),
            "median_cpu_s": statistics.median(w["cpu_s"] for w in wd),
            "rss_mb": max(w["rss_mb"] for w in wd),
            "torch": any(w["torch"] for w in wd),
        }
    if "clustered" in parts:
        report["clustered"] = [clustered_once() for _ in range(args.trials)]
    if "refill" in parts or "recovery" in parts:
        report.update(_refill_and_recovery(args.trials, parts))
    report["loadavg_after"] = os.getloadavg()[0]
    print(json.dumps(report, indent=2))


def _refill_and_recovery(trials: int, parts: set[str]) -> dict[str, Any]:
    report: dict[str, Any] = {}
    if "refill" in parts:
        for key, warm in (("refill", True), ("refill_cold", False)):
            refills = [refill_once(warm) for _ in range(trials)]
            report[key] = {
                "kill_to_ready_reserve_s": [r["kill_to_ready_reserve_s"] for r in refills],
                "median_kill_to_ready_reserve_s": statistics.median(
                    r["kill_to_ready_reserve_s"] for r in refills
                ),
                "in_process_restart_s": [r["in_process_restart_s"] for r in refills],
            }
    if "recovery" not in parts:
        return report
    modes = ("torchrun", "in_job", "in_job_cold", "in_process")
    rec: dict[str, list[float]] = {m: [] for m in modes}
    cold: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(trials):  # interleaved: the machine's load changes over the run
        for m in modes:
            r, c = recovery_once(m)
            rec[m].append(r)
            cold[m].append(c)
    med = {m: statistics.median(v) for m, v in rec.items()}
    report.update(
        recovery_s=rec,
        median_recovery_s=med,
        cold_start_s=cold,
        median_cold_start_s={m: statistics.median(v) for m, v in cold.items()},
        ratio_vs_torchrun={m: med[m] / med["torchrun"] for m in modes if m != "torchrun"},
    )
    return report


if __name__ == "__main__":
    main()
