"""Goodput: the example job with the same fault plan on two stacks, in one invocation.

(a) restartable: ``python -m inprocess.launch`` + ``examples/train.py`` (in-process restart, warm
    reserves, local checkpoint every step, async persistent every N steps, re-run of NaN steps);
(b) baseline: ``torchrun --max-restarts=K`` + ``benchmarks/goodput_baseline.py`` (new processes
    after every fault, synchronous ``torch.distributed.checkpoint.save`` every N steps).

Both train the same model on the same number of active ranks. Prints one JSON document: wall
time, downtime by term and goodput for each stack, and the downtime ratio (ours / baseline).

    python benchmarks/goodput.py            # demo plan, 300 steps
    python benchmarks/goodput.py --quick    # shorter
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from inprocess import faults

ROOT = Path(__file__).resolve().parents[1]


def run(cmd: list[str], *, timeout: float) -> tuple[int, float, str]:
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, time.monotonic() - start, proc.stdout + proc.stderr


def terms(report: dict[str, Any]) -> dict[str, Any]:
    faults = report["faults"]
    return {
        **report["totals"],
        "detection_s": round(sum(f["detection_s"] for f in faults), 4),
        "shutdown_restart_s": round(sum(f["shutdown_restart_s"] for f in faults), 4),
        "reload_s": round(sum(f["reload_s"] for f in faults), 4),
        "lost_work_s": round(sum(f["lost_work_s"] for f in faults), 4),
        "faults": [{k: f[k] for k in ("fault", "downtime_s", "tier") if k in f} for f in faults],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--faults", default="demo")
    p.add_argument("--active", type=int, default=2, help="active ranks on both stacks")
    p.add_argument("--persistent-every", type=int, default=50)
    p.add_argument("--soft-timeout", type=float, default=2.0)
    p.add_argument("--quick", action="store_true", help="120 steps, persistent every 20")
    args = p.parse_args()
    if args.quick:
        args.steps, args.persistent_every = 120, 20
    plan = faults.parse_plan(args.faults, steps=args.steps)
    reserves = sum(f.loses_rank for f in plan)
    common = [
        "--steps",
        str(args.steps),
        "--faults",
        args.faults,
        "--persistent-every",
        str(args.persistent_every),
        "--soft-timeout",
        str(args.soft_timeout),
    ]
    tmp = Path(tempfile.mkdtemp(prefix="goodput-"))
    results: dict[str, Any] = {"config": {**vars(args), "reserves": reserves}}

    ours_dir = tmp / "ours"
    rc, wall, out = run(
        [
            sys.executable,
            "-m",
            "inprocess.launch",
            "--nproc-per-node",
            str(args.active + reserves),
            "examples/train.py",
            *common,
            "--active",
            str(args.active),
            "--run-dir",
            str(ours_dir),
        ],
        timeout=900,
    )
    results["restartable"] = _collect("restartable", rc, wall, out, ours_dir)

    base_dir = tmp / "baseline"
    rc, wall, out = run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(args.active),
            "--max-restarts",
            str(3 * len(plan) + 1),
            "benchmarks/goodput_baseline.py",
            *common,
            "--run-dir",
            str(base_dir),
        ],
        timeout=900,
    )
    results["torchrun_dcp"] = _collect("torchrun_dcp", rc, wall, out, base_dir)

    ours, base = results["restartable"], results["torchrun_dcp"]
    if ours.get("downtime_s") is not None and base.get("downtime_s"):
        results["downtime_ratio"] = round(ours["downtime_s"] / base["downtime_s"], 4)
        results["goodput_gain"] = round(ours["goodput"] - base["goodput"], 4)
        results["target_downtime_ratio"] = 0.2
    print(json.dumps(results, indent=2))
    return 0 if "downtime_ratio" in results else 1


def _collect(name: str, rc: int, wall: float, out: str, run_dir: Path) -> dict[str, Any]:
    report_file = run_dir / "report.json"
    if rc != 0 or not report_file.exists():
        return {"exit": rc, "error": f"{name} run failed", "output_tail": out[-4000:]}
    return {
        "exit": rc,
        "process_wall_s": round(wall, 3),
        **terms(json.loads(report_file.read_text())),
    }


if __name__ == "__main__":
    sys.exit(main())
