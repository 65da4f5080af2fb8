"""The DDP tutorial ported (examples/ddp_tutorial.py), rank 0 SIGKILLed with a warm reserve
waiting: seconds from the kill to the first step after the restart, run after run.

    python benchmarks/warm_reserve.py --repeats 3
    python benchmarks/warm_reserve.py --repeats 3 --baseline /path/to/an/older/checkout

Both clocks are ``time.time()`` on this machine: the example prints ``KILL t`` just before rank
0 kills itself and ``FIRST_STEP 1 t`` on the new rank 0's first step. ``--baseline ROOT``
alternates runs with the same example under the checkout at ROOT (its PYTHONPATH), e.g. one
before reserves imported what DDP needs first. Prints one JSON object, with the load average
before each run (the machine's other work moves every figure).
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

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "ddp_tutorial.py"


def one_run(root: Path) -> dict[str, float]:
    """One kill of rank 0 at step 16 (3 processes: 2 active, 1 reserve), with ``root`` on the
    PYTHONPATH; the fault to the first step, in seconds."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as d:
        ckpt = str(Path(d) / "ckpt")
        launch = [sys.executable, "-m", "restartable.launch", "--nproc-per-node", "3"]
        cmd = [*launch, str(EXAMPLE), "2", "1", "--kill-at", "16", "--ckpt", ckpt]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=d)
    text = out.stdout + out.stderr
    kill = re.search(r"KILL ([0-9.]+)", text)
    first = re.search(r"FIRST_STEP 1 ([0-9.]+)", text)
    if out.returncode != 0 or kill is None or first is None:
        raise RuntimeError(f"{cmd} failed ({out.returncode}):\n{text}")
    return {"fault_to_first_step_s": float(first.group(1)) - float(kill.group(1)), "load": load}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--baseline", type=Path, default=None)
    args = p.parse_args()
    roots = {"this": REPO, **({"baseline": args.baseline} if args.baseline else {})}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in roots}
    for _ in range(args.repeats):
        for name, root in roots.items():
            runs[name].append(one_run(root))
    result = {
        name: {
            "median_s": round(statistics.median(r["fault_to_first_step_s"] for r in rs), 3),
            "runs": [{k: round(v, 3) for k, v in r.items()} for r in rs],
        }
        for name, rs in runs.items()
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
