"""The same DDP script under torchrun and under ``inprocess.launch``, back to back: start-up to
the first step and step time, as ratios (ours / torchrun's); and the restart of the
README-style script (examples/minimal.py) with one fault, run after run.

    python benchmarks/torchrun_vs_launch.py --repeats 3 --nproc 2 --restarts 20

The torchrun side runs the plain torchrun script (init_process_group, DDP, a loop); our side the
same model and loop decorated with @restartable, as a user ports it (docs/inprocess.md, "Porting
a torchrun script"). Start-up: from starting the launcher to the end of the first step on rank
0 (wall clock, both in this process's clock domain: time.time()). Prints one JSON object.
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
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# The workload: nanoGPT-sized on CPU is too slow for a benchmark loop; an MLP with a few
# matmuls per step shows the intra-op thread effect (OMP_NUM_THREADS) all the same.
SCRIPT = """
import os, sys, time, json
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
mode, steps = sys.argv[1], int(sys.argv[2])

def loop():
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(),
                                    torch.nn.Linear(1024, 256)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        loss = model(torch.randn(64, 256)).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        times.append(time.perf_counter() - t0)
        if step == 0 and dist.get_rank() == 0:
            print("FIRST_STEP", time.time(), flush=True)
    if dist.get_rank() == 0:
        print("STEP_TIMES", json.dumps(times[5:]), flush=True)

if mode == "plain":
    dist.init_process_group("gloo")
    loop()
    dist.destroy_process_group()
else:
    from restartable.inprocess import restartable
    restartable(soft_timeout=30.0, hard_timeout=60.0, backend="gloo")(loop)()
"""


def _run(cmd: list[str], env: dict[str, str]) -> tuple[float, float, str]:
    """(start-up s, median step s, output) of one launch."""
    t0 = time.time()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    text = out.stdout + out.stderr
    first = re.search(r"FIRST_STEP ([0-9.]+)", text)
    times = re.search(r"STEP_TIMES (\[.*\])", text)
    if out.returncode != 0 or first is None or times is None:
        raise RuntimeError(f"{cmd} failed ({out.returncode}):\n{text}")
    return float(first.group(1)) - t0, statistics.median(json.loads(times.group(1))), text


def compare(repeats: int, nproc: int, steps: int) -> dict[str, object]:
    """Alternate torchrun and our launcher ``repeats`` times each."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("OMP_NUM_THREADS", None)  # each launcher's own default
    with tempfile.TemporaryDirectory() as d:
        script = Path(d) / "ddp.py"
        script.write_text(SCRIPT)
        torchrun = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(nproc),
            str(script),
            "plain",
            str(steps),
        ]
        ours = [
            sys.executable,
            "-m",
            "restartable.launch",
            "--nproc-per-node",
            str(nproc),
            str(script),
            "restartable",
            str(steps),
        ]
        rows: dict[str, list[tuple[float, float]]] = {"torchrun": [], "ours": []}
        for _ in range(repeats):
            for name, cmd in (("torchrun", torchrun), ("ours", ours)):
                startup, step, _ = _run(cmd, env)
                rows[name].append((startup, step))
    med = {
        k: (statistics.median(s for s, _ in v), statistics.median(t for _, t in v))
        for k, v in rows.items()
    }
    return {
        "runs": {
            k: [{"startup_s": round(s, 3), "step_s": round(t, 5)} for s, t in v]
            for k, v in rows.items()
        },
        "startup_ratio": round(med["ours"][0] / med["torchrun"][0], 3),
        "step_ratio": round(med["ours"][1] / med["torchrun"][1], 3),
    }


def restarts(runs: int) -> dict[str, object]:
    """examples/minimal.py with one fault, ``runs`` times: seconds from the fault to the state
    restored (the framework's console line), and whether torch's socket noise appeared."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    took: list[float] = []
    noisy = 0
    for _ in range(runs):
        with tempfile.TemporaryDirectory() as d:
            cmd = [
                sys.executable,
                "-m",
                "restartable.launch",
                "--nproc-per-node",
                "3",
                "examples/minimal.py",
                "--fail-at",
                "30",
                "--ckpt",
                d,
            ]
            out = subprocess.run(
                cmd, env=env, capture_output=True, text=True, timeout=600, cwd=REPO
            )
            text = out.stdout + out.stderr
            m = re.search(r"restart 1: .* ([0-9.]+) s after the fault", text)
            if out.returncode != 0 or m is None:
                raise RuntimeError(f"minimal.py failed ({out.returncode}):\n{text}")
            took.append(float(m.group(1)))
            noisy += "waitForInput" in text or "still referenced" in text
    return {
        "restart_s": took,
        "under_0.3_s": sum(t < 0.3 for t in took),
        "runs": runs,
        "runs_with_socket_noise_or_warning": noisy,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="launches of each (0: skip)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--restarts", type=int, default=20, help="runs of minimal.py (0: skip)")
    a = p.parse_args()
    result: dict[str, object] = {"load_avg": os.getloadavg()[0]}
    if a.repeats:
        result["torchrun_vs_ours"] = compare(a.repeats, a.nproc, a.steps)
    if a.restarts:
        result["readme_restart"] = restarts(a.restarts)
    result["load_avg_after"] = os.getloadavg()[0]
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
