"""What sealing store values costs (docs/security.md); prints one JSON document.

    python benchmarks/sealing_cost.py

Three figures, each against the unsealed baseline in the same run, on a local TCPStore:

* ``per_value_us``: seal + open of one typical protocol value (a fault record line).
* ``restart_protocol``: the store calls one rank makes in a restart (fault record, outcome,
  restart barrier and decision, participants) through a ``SealedStore`` vs the raw client,
  for a job of one rank (every call is a real round trip), as a share of the restart latency
  that ``benchmarks/restart_latency.py`` measures (``--restart-s``, default 0.5 s).
* ``per_step_exchange``: one local-tier step agreement (``StoreExchange`` gather + publish +
  receive, world 1) with and without the sealer: what a step that saves to the local tier pays.
* ``in_job`` (``--job FAULTS``, default 5; 0 skips it): a real job of 2 ranks under
  ``inprocess.launch`` restarts in place FAULTS times (``benchmarks/sealing_cost_job.py``):
  each restart's latency and the time rank 0 spent sealing and opening values during it, in
  this same run; ``share`` is sealing / restart, the figure docs/security.md bounds by 2 %.
  ``restart_protocol.share_of_restart`` then uses the median restart measured here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from restartable.checkpoint.exchange import StoreExchange
from restartable.checkpoint.sealing import Sealer
from restartable.inprocess.clock import SYSTEM
from restartable.inprocess.errors import FaultRecord
from restartable.inprocess.protocol import fault_records, iteration_end, restart_meeting
from restartable.inprocess.protocol.sealed_store import SealedStore
from restartable.inprocess.protocol.store import as_store


def _median_us(fn: Any, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _restart(store: Any, it: int) -> None:
    rec = FaultRecord(iteration=it, initial_rank=0, kind="exception", detail="x" * 200, step=it)
    restart_meeting.set_participants(store, it, 1)
    fault_records.record_fault(store, rec)
    iteration_end.wait_outcome(store, it, timeout=5.0, clock=SYSTEM)
    restart_meeting.restart_barrier(
        store, it, initial_rank=0, participants=[0], decide=lambda faults: '{"go": 1}', timeout=5
    )


def _in_job(faults: int) -> dict[str, Any]:
    """Run ``sealing_cost_job.py`` under the launcher; its restarts' latency and sealing time."""
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(repo), "PYTHONUNBUFFERED": "1"}
    job = repo / "benchmarks" / "sealing_cost_job.py"
    cmd = [
        sys.executable,
        "-m",
        "restartable.launch",
        "--nproc-per-node",
        "2",
        str(job),
        str(faults),
    ]
    done = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    lines = done.stdout.splitlines()
    rows = [json.loads(ln.split("BENCH ", 1)[1]) for ln in lines if "BENCH " in ln]
    if done.returncode != 0 or len(rows) != faults:
        raise SystemExit(f"the job failed (exit {done.returncode}):\n{done.stdout}{done.stderr}")
    shares = [r["sealing_s"] / r["restart_s"] for r in rows]
    return {
        "restarts": faults,
        "restart_ms_median": round(statistics.median(r["restart_s"] for r in rows) * 1e3, 2),
        "sealing_ms_median": round(statistics.median(r["sealing_s"] for r in rows) * 1e3, 3),
        "calls_per_restart_median": statistics.median(r["calls"] for r in rows),
        "share_median": round(statistics.median(shares), 5),
        "share_max": round(max(shares), 5),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--n", type=int, default=300)
    p.add_argument("--restart-s", type=float, default=0.5, help="used with --job 0 only")
    p.add_argument("--job", type=int, default=5, help="in-place restarts of a real job")
    args = p.parse_args()
    in_job = _in_job(args.job) if args.job else None
    if in_job is not None:
        args.restart_s = in_job["restart_ms_median"] / 1e3
    sealer = Sealer(os.urandom(32))
    value = json.dumps({"iteration": 3, "kind": "exception", "detail": "x" * 200}) + "\n"
    per_value = _median_us(lambda: sealer.open("k", sealer.seal("k", value)), args.n * 10)

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    raw = dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False)
    sealed = SealedStore(raw, sealer)
    counter = iter(range(10**9))
    out: dict[str, Any] = {"per_value_us": round(per_value, 2)}
    rows = {}
    plain = as_store(raw)
    for name, store in (("raw", plain), ("sealed", sealed), ("raw2", plain), ("sealed2", sealed)):
        rows[name] = _median_us(lambda s=store: _restart(s, next(counter)), args.n)
    base = min(rows["raw"], rows["raw2"])
    cost = min(rows["sealed"], rows["sealed2"]) - base
    out["restart_protocol"] = {
        "raw_us": round(base, 1),
        "sealed_us": round(base + cost, 1),
        "added_us": round(cost, 1),
        "share_of_restart": round(cost / (args.restart_s * 1e6), 6),
    }

    def step(sealer_or_none: Sealer | None, ns: str) -> None:
        ex = StoreExchange(raw, ns, rank=0, world=1, cancel=threading.Event(), timeout=5.0,
                           sealer=sealer_or_none)  # fmt: skip
        ex.gather("verdict", {"step": 12, "have": [12, 11]})
        ex.publish("agreed", 12)
        ex.receive("agreed")

    steps = {}
    for name, s in (("raw", None), ("sealed", sealer), ("raw2", None), ("sealed2", sealer)):
        steps[name] = _median_us(lambda s=s: step(s, f"x{next(counter)}"), args.n)
    base = min(steps["raw"], steps["raw2"])
    out["per_step_exchange"] = {
        "raw_us": round(base, 1),
        "added_us": round(min(steps["sealed"], steps["sealed2"]) - base, 1),
    }
    if in_job is not None:
        out["in_job"] = in_job
    out["load_average"] = os.getloadavg()
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
