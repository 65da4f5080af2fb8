"""Process-level recovery costs of ``python -m inprocess.launch`` (CPU, gloo, localhost).

In one invocation, with the rank script of the launcher tests
(``tests/dist/workers_launcher_recovery.py``: an all_reduce loop that checkpoints every step to
a small JSON file and resumes from it on every start):

* ``refill``: 3 active ranks + 1 reserve under ``--max-respawns 1``; ctx.rank 1 SIGKILLs itself.
  Measured from the kill to the respawned process being a ready reserve (registered in the
  store, watchdog running), polled every 5 ms from this process through the job's store; the
  in-process restart that the reserve made meanwhile is reported next to it.
* ``recovery`` of the same 2-rank job after rank 1 raises at step 3, from the raise to the
  first step finished after it, less one step time (no work is lost: a checkpoint per step):
  ``in_process`` (``@restartable`` restarts train() in place), ``in_job`` (``max_iterations=1``
  makes the in-process path give up; ``--max-restarts 1`` restarts every process), and
  ``torchrun`` (the same loop without ``@restartable`` under ``torchrun --max-restarts 1``,
  the baseline). Ratios are against torchrun, measured in the same run, trials interleaved.
  ``cold_start_s``: launch -> first step of the same runs (an in-job restart is a cold start
  of every process, plus noticing that the in-process path stopped).

    python benchmarks/launcher_recovery.py              # 3 trials each
    python benchmarks/launcher_recovery.py --trials 1
"""

from __future__ import annotations

import argparse
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
LAUNCH = ["-m", "inprocess.launch", "--monitor-interval", "0.02", "--stop-grace", "2"]


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


def refill_once() -> dict[str, float]:
    """Kill -> respawned process registered as a ready reserve (seconds)."""
    from inprocess.protocol import job_keys
    from inprocess.protocol.store import as_store
    from inprocess.store_server import client

    d = Path(tempfile.mkdtemp(prefix="bench-refill-"))
    port = _free_port()
    opts = {"dir": str(d), "steps": 30, "step_time": STEP_S,
            "kills": [{"iteration": 0, "rank": 1, "step": 3}],
            "config": {**CONFIG, "active_world_size": 3}}  # fmt: skip
    cmd = [sys.executable, *LAUNCH, "--nproc-per-node", "4", "--master-port", str(port),
           "--max-respawns", "1", SCRIPT, json.dumps(opts)]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)  # fmt: skip
    registered = None
    try:
        deadline = time.monotonic() + 120
        store: Any = None
        while registered is None and time.monotonic() < deadline:
            try:
                store = store or as_store(client("127.0.0.1", port, timeout=5.0))
                if job_keys.registered_joiners(store):
                    registered = time.time()
            except Exception:
                store = None
            time.sleep(0.005)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    if proc.returncode != 0 or registered is None:
        raise RuntimeError(f"refill job failed ({proc.returncode}):\n{out.decode()[-4000:]}")
    killed = _lines(d / "kills.jsonl")[0]["time"]
    restart = next(
        json.loads(line.split("restart ", 1)[1])
        for line in out.decode().splitlines()
        if "inprocess.restart.loop: restart {" in line
    )
    return {
        "kill_to_ready_reserve_s": registered - killed,
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
    elif mode == "in_job":
        opts["config"]["max_iterations"] = 1
        cmd = [*LAUNCH, "--nproc-per-node", "2", "--max-restarts", "1", SCRIPT, json.dumps(opts)]
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=3)
    args = p.parse_args()
    refills = [refill_once() for _ in range(args.trials)]
    modes = ("torchrun", "in_job", "in_process")
    rec: dict[str, list[float]] = {m: [] for m in modes}
    cold: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.trials):  # interleaved: the machine's load changes over the run
        for m in modes:
            r, c = recovery_once(m)
            rec[m].append(r)
            cold[m].append(c)
    med = {m: statistics.median(v) for m, v in rec.items()}
    report = {
        "trials": args.trials,
        "refill": {
            "kill_to_ready_reserve_s": [r["kill_to_ready_reserve_s"] for r in refills],
            "median_kill_to_ready_reserve_s": statistics.median(
                r["kill_to_ready_reserve_s"] for r in refills
            ),
            "in_process_restart_s": [r["in_process_restart_s"] for r in refills],
        },
        "recovery_s": rec,
        "median_recovery_s": med,
        "cold_start_s": cold,
        "median_cold_start_s": {m: statistics.median(v) for m, v in cold.items()},
        "ratio_vs_torchrun": {m: med[m] / med["torchrun"] for m in ("in_job", "in_process")},
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
