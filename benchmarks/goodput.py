"""Goodput: the example job with the same fault plan on two stacks, in one invocation.

(a) restartable: ``python -m restartable.launch`` + ``examples/train.py`` (in-process restart, warm
    reserves, local checkpoint every step, async persistent every N steps, re-run of NaN steps);
(b) baseline: ``torchrun --max-restarts=K`` + ``benchmarks/goodput_baseline.py`` (new processes
    after every fault, synchronous ``torch.distributed.checkpoint.save`` every N steps).

(c) restartable with learned timeouts: (a) plus ``--calculate-timeouts`` (the example's
    sections ``setup``/``step``/``checkpointing``, ``soft_timeout`` left as configured): a hang
    inside a step is caught at the step's learned timeout instead of ``soft_timeout``.

Both stacks train the same model on the same number of active ranks, and both are measured by
the same code: each run journals what it does (restartable's run journal: ``@restartable`` on
(a)/(c), the baseline script itself on (b)) and writes ``inprocess.report``'s report of it to
``RUN_DIR/report.json`` (terms defined in ``inprocess.report.downtime``). Prints one JSON document:
per
run its wall, startup, productive and downtime seconds, goodput and restarts, and one entry per
fault window (the injected fault's name and its terms in seconds); the hang's downtime; and the
ratios ours / baseline measured in the same invocation.

    python benchmarks/goodput.py                      # demo plan, 300 steps, all three runs
    python benchmarks/goodput.py --quick              # shorter
    python benchmarks/goodput.py --safety-factor 3    # learned timeout = 3 x longest step
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

from restartable.inprocess import faults

ROOT = Path(__file__).resolve().parents[1]


def run(cmd: list[str], *, timeout: float) -> tuple[int, float, str]:
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, time.monotonic() - start, proc.stdout + proc.stderr


TERMS = ("lost_before_s", "detection_s", "restart_s", "reload_s", "redo_s", "downtime_s")


def terms(report: dict[str, Any]) -> dict[str, Any]:
    """The figures of one run's report.json (``LaunchReport.as_dict()`` + final step and loss)."""
    windows = report["faults"]
    return {
        **{
            k: round(report[k], 4)
            for k in ("wall_s", "startup_s", "productive_s", "downtime_s", "checkpoint_s")
        },
        "goodput": round(report["goodput"], 4),
        "restarts": report["restarts"],
        "final_step": report["final_step"],
        "final_loss": report["final_loss"],
        # Each term summed over the fault windows (checkpoint stalls are "checkpoint_s").
        "windows_total": {k: round(sum(w[k] for w in windows), 4) for k in TERMS},
        "windows": [
            {"fault": w["fault"], "cause": w["cause"], "tier": w["tier"]}
            | {k: round(w[k], 4) for k in TERMS}
            for w in windows
        ],
        # The hang (GIL released) of the plan: what learned section timeouts shorten.
        "hang_downtime_s": next(
            (round(w["downtime_s"], 4) for w in windows if (w["fault"] or "").startswith("hang@")),
            None,
        ),
    }


RATIO_MIN_S = 0.1  # a baseline term below this is timer noise here: no ratio for it


def ratios(ours: dict[str, Any], base: dict[str, Any]) -> dict[str, float | None]:
    """ours / baseline for the downtime, each term summed over the windows and the hang; None
    where the baseline's figure is under ``RATIO_MIN_S`` (a ratio of two noises)."""

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 4) if a is not None and b is not None and b >= RATIO_MIN_S else None

    out = {"downtime": ratio(ours["downtime_s"], base["downtime_s"])}
    for k in TERMS:
        out[k.removesuffix("_s")] = ratio(ours["windows_total"][k], base["windows_total"][k])
    out["hang_downtime"] = ratio(ours["hang_downtime_s"], base["hang_downtime_s"])
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--faults", default="demo")
    p.add_argument("--active", type=int, default=2, help="active ranks on both stacks")
    p.add_argument("--persistent-every", type=int, default=50)
    p.add_argument("--soft-timeout", type=float, default=2.0)
    p.add_argument("--quick", action="store_true", help="120 steps, persistent every 20")
    p.add_argument(
        "--safety-factor",
        type=float,
        default=5.0,
        help="learned-timeout run: timeout = this x the longest step seen (default 5.0)",
    )
    p.add_argument("--no-learned", action="store_true", help="skip the learned-timeout run (c)")
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

    ours_cmd = [
        sys.executable,
        "-m",
        "restartable.launch",
        "--nproc-per-node",
        str(args.active + reserves),
        "examples/train.py",
        *common,
        "--active",
        str(args.active),
    ]
    ours_dir = tmp / "ours"
    rc, wall, out = run([*ours_cmd, "--run-dir", str(ours_dir)], timeout=900)
    results["restartable"] = _collect("restartable", rc, wall, out, ours_dir)
    if not args.no_learned:
        learned_dir = tmp / "learned"
        rc, wall, out = run(
            [
                *ours_cmd,
                "--run-dir",
                str(learned_dir),
                "--calculate-timeouts",
                "--safety-factor",
                str(args.safety_factor),
            ],
            timeout=900,
        )
        learned = _collect("restartable_learned", rc, wall, out, learned_dir)
        state = learned_dir / "ft_state.json"
        if state.exists():
            learned["learned_timeouts"] = json.loads(state.read_text())["timeouts"]
        results["restartable_learned"] = learned

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
        results["ratios_ours_over_baseline"] = ratios(ours, base)
        results["downtime_ratio"] = results["ratios_ours_over_baseline"]["downtime"]
        results["goodput_gain"] = round(ours["goodput"] - base["goodput"], 4)
        results["target_downtime_ratio"] = 0.2
    learned = results.get("restartable_learned", {})
    if learned.get("downtime_s") is not None and base.get("downtime_s"):
        results["ratios_learned_over_baseline"] = ratios(learned, base)
        results["downtime_ratio_learned"] = results["ratios_learned_over_baseline"]["downtime"]
        results["target_downtime_ratio_learned"] = 0.08
        results["target_hang_downtime_s_learned"] = 0.5
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
