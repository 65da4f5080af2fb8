"""Costs of silent-data-corruption scrubbing in the example job (examples/train.py, 3 active ranks
+ 1 warm reserve under ``python -m restartable.launch``).

Run: ``python benchmarks/sdc_scrub.py [--quick]``. Prints one JSON document with:

* ``step_time``: the active ranks' steady-state step time with ``--scrub reserve`` and with
  ``--scrub off``, launched interleaved (off, on, off, on, ...) so that machine noise hits both
  alike; the ratio on/off (target <= 1.02 with a reserve). Taken from the example's progress
  lines (steps/s of rank 0 between two lines; the first two lines, startup and warm-up, are
  dropped). On a machine where the reserve shares the CPUs with the active ranks, its
  re-computations take CPU time from them; with a device per rank (the intended setting) they
  do not.
* ``--blocks B`` instead: scrubbing on and off in alternate blocks of B steps of the same runs
  (``--scrub-blocks``), the ratio of the pooled medians and the median ratio of each on block
  to the off block after it: drift of a shared machine's load between runs cancels.
* ``latency``: for each K (``--scrub-every``), a run with ``sdc@rank1:step40``: the step at which
  the corruption was found, the latency in steps, and the steps rolled back.
* ``reserve``: the reserve's time per check (decode, forward/backward, digest, answer), from its
  own count in the clean runs.
* ``false_positives``: findings in the clean runs with scrubbing on (must be 0); the slow test
  tests/dist/test_sdc_example.py::test_no_false_positive_in_repeated_clean_runs runs 50.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout, uninstalled
from restartable.inprocess import journal  # noqa: E402

RATE = re.compile(r"step +(\d+) +loss [\d.]+ +([\d.]+) steps/s")
RESERVE = re.compile(r"this reserve checked (\d+) step\(s\) in ([\d.]+) s")


def launch(run_dir: Path, *, steps: int, faults: str, extra: list[str], active: int = 3) -> str:
    """One run of the example: ``active`` ranks and one warm reserve."""
    argv = [sys.executable, "-m", "restartable.launch", "--nproc-per-node", str(active + 1)]
    argv += ["examples/train.py", "--steps", str(steps), "--faults", faults]
    argv += ["--active", str(active), "--run-dir", str(run_dir), "--log-every", "10", *extra]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{argv} failed ({done.returncode}):\n{done.stdout[-3000:]}")
    return done.stdout


def rank_logs(run_dir: Path) -> str:
    return "".join(p.read_text() for p in sorted((run_dir / "logs").glob("*/rank*.log")))


def findings(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in journal.read(run_dir / "journal") if r["event"] == "sdc_finding"]


def step_times(out: str) -> list[float]:
    rates = [float(m[2]) for m in RATE.finditer(out)][2:]
    return [1.0 / r for r in rates if r > 0]


def block_times(out: str, blocks: int) -> tuple[dict[str, list[float]], list[float]]:
    """A ``--scrub-blocks`` run's step times by mode (a progress line per block: on in the even
    blocks), and the ratio of each on block to the off block after it (adjacent in time, so a
    drift of the machine's load cancels). The first two blocks (startup, warm-up) dropped."""
    times: dict[str, list[float]] = {"off": [], "reserve": []}
    by_block: dict[int, float] = {}
    for m in RATE.finditer(out):
        block = int(m[1]) // blocks - 1
        if block >= 2 and float(m[2]) > 0:
            by_block[block] = 1.0 / float(m[2])
            times["reserve" if block % 2 == 0 else "off"].append(by_block[block])
    pairs = [by_block[b] / by_block[b + 1] for b in by_block if b % 2 == 0 and b + 1 in by_block]
    return times, pairs


def interleaved(args: argparse.Namespace, tmp: Path) -> None:
    """``--blocks B``: scrubbing on and off in alternate blocks of B steps of the same runs."""
    times: dict[str, list[float]] = {"off": [], "reserve": []}
    pairs: list[float] = []
    loads = [_loadavg()]
    extra = ["--scrub", "reserve", "--scrub-every", str(args.every)]
    extra += ["--scrub-blocks", str(args.blocks), "--log-every", str(args.blocks)]
    for i in range(args.rounds or 2):
        steps = args.steps or 400
        out = launch(tmp / f"b{i}", steps=steps, faults="none", extra=extra, active=args.active)
        loads.append(_loadavg())
        got, ratios = block_times(out, args.blocks)
        for mode in times:
            times[mode] += got[mode]
        pairs += ratios
    off, on = statistics.median(times["off"]), statistics.median(times["reserve"])
    result = {
        "machine_note": f"CPU ranks over gloo on {os.cpu_count()} CPUs: {args.active} active "
        "rank(s) and 1 reserve; scrubbing on in even blocks, off in odd blocks of the same runs",
        "load_average_1min": {"min": min(loads), "max": max(loads), "each_run": loads},
        "blocks": args.blocks,
        "every": args.every,
        "off_median_s": off,
        "reserve_median_s": on,
        "ratio": on / off,
        "adjacent_pairs": {"count": len(pairs), "median_ratio": statistics.median(pairs)},
        "samples": {k: len(v) for k, v in times.items()},
    }
    print(json.dumps(result, indent=2))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="2 rounds of 100 steps, K in (2, 5)")
    p.add_argument("--every", type=int, default=5, help="K of the step-time runs (default 5)")
    p.add_argument("--rounds", type=int, help="off/on rounds (default 3; --quick: 2)")
    p.add_argument("--steps", type=int, help="steps per step-time run (default 200; --quick: 100)")
    p.add_argument(
        "--active",
        type=int,
        default=3,
        help="active ranks of the step-time runs, beside one reserve (default 3; 1 gives the\n"
        "reserve a core of its own on a 2-core machine)",
    )
    p.add_argument("--no-latency", action="store_true", help="skip the sdc@rank1:step40 runs")
    p.add_argument(
        "--blocks",
        type=int,
        default=0,
        metavar="B",
        help="instead: time scrubbing on/off in alternate blocks of B steps within each run\n"
        "(--scrub-blocks; --rounds runs, default 2, of --steps steps, default 400)",
    )
    args = p.parse_args()
    if args.blocks > 0:
        interleaved(args, Path(tempfile.mkdtemp(prefix="sdc-bench-")))
        return
    rounds, steps = (2, 100) if args.quick else (3, 200)
    rounds, steps = args.rounds or rounds, args.steps or steps
    ks = () if args.no_latency else (2, 5) if args.quick else (1, 2, 5, 10)
    tmp = Path(tempfile.mkdtemp(prefix="sdc-bench-"))
    times: dict[str, list[float]] = {"off": [], "reserve": []}
    checks, check_s, false_pos = 0, 0.0, 0
    loads = [_loadavg()]
    per_run: dict[str, list[float]] = {"off": [], "reserve": []}  # each run's median, in order
    for i in range(rounds):
        # Alternate which mode goes first, so that a drift of the machine's load within a
        # round does not favour one mode.
        for mode in ("off", "reserve") if i % 2 == 0 else ("reserve", "off"):
            run_dir = tmp / f"{mode}{i}"
            extra = ["--scrub", mode, "--scrub-every", str(args.every)]
            out = launch(run_dir, steps=steps, faults="none", extra=extra, active=args.active)
            loads.append(_loadavg())
            times[mode] += step_times(out)
            per_run[mode].append(round(statistics.median(step_times(out)), 4))
            false_pos += len(findings(run_dir))
            # From the reserve's own log only (the launcher's output repeats the line).
            for m in RESERVE.finditer(rank_logs(run_dir)):
                checks, check_s = checks + int(m[1]), check_s + float(m[2])
    latency = []
    for k in ks:
        run_dir = tmp / f"sdc-k{k}"
        launch(run_dir, steps=80, faults="sdc@rank1:step40", extra=["--scrub-every", str(k)])
        (f,) = findings(run_dir)
        latency.append(
            {
                "every": k,
                "rank_checked_every_steps": 3 * k,
                "found_at_step": f["detected_at"],
                "latency_steps": f["detected_at"] - 40,
                "rolled_back_steps": f["steps_rolled_back"],
                "verdict": f["verdict"],
            }
        )
    off, on = statistics.median(times["off"]), statistics.median(times["reserve"])
    print(
        json.dumps(
            {
                "machine_note": f"CPU ranks over gloo on {os.cpu_count()} CPUs: {args.active} "
                "active rank(s) and 1 reserve",
                "load_average_1min": {"min": min(loads), "max": max(loads), "each_run": loads},
                "step_time": {
                    "active": args.active,
                    "rounds": rounds,
                    "steps": steps,
                    "every": args.every,
                    "off_median_s": off,
                    "reserve_median_s": on,
                    "ratio": on / off,
                    "samples": {k: len(v) for k, v in times.items()},
                    "run_medians_s": per_run,
                },
                "latency": latency,
                "reserve": {
                    "checks": checks,
                    "seconds_per_check": check_s / checks if checks else None,
                },
                "false_positives": {"clean_runs_scrubbed": rounds, "findings": false_pos},
            },
            indent=2,
        )
    )


def _loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


if __name__ == "__main__":
    main()
