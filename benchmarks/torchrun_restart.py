"""An unmodified torchrun script's restart: under ``inprocess.launch`` (re-run in place) against
``torchrun --max-restarts 1`` (new processes), on the same script, in one run.

    python benchmarks/torchrun_restart.py --repeats 3 --nproc 2 --fault raise
    python benchmarks/torchrun_restart.py --repeats 3 --nproc 2 --fault kill

The script is torchrun's pattern and nothing else: its own ``init_process_group`` /
``destroy_process_group``, RANK from the environment, a DDP MLP, a snapshot file that rank 0
rewrites after every step and every rank resumes from. RANK 1 faults once at ``--fault-step``
(``raise``: an exception; ``kill``: SIGKILL of itself). Measured per run: seconds from the
fault (the faulting rank's ``time.time()`` just before it) to the end of the first step after
the restart on RANK 0 (its ``time.time()``; one host, one clock). Under our launcher a ``kill``
is taken over by one warm reserve (``--nproc`` + 1 processes, ``active_world_size`` =
``--nproc``); torchrun restarts its whole worker group. Prints one JSON object; the machine's
load average is in it (timings on a shared host vary with it).
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

SCRIPT = """
import os, sys, time
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

steps, fault_step, kind, workdir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
dist.init_process_group("gloo")
rank = int(os.environ["RANK"])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
snapshot, marker, start = os.path.join(workdir, "snapshot.pt"), os.path.join(workdir, "fired"), 0
if os.path.exists(snapshot):
    saved = torch.load(snapshot)
    model.load_state_dict(saved["model"])
    start = saved["step"] + 1
model = DDP(model)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
for step in range(start, steps):
    if step == fault_step and rank == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        print("FAULT", time.time(), flush=True)
        if kind == "raise":
            raise RuntimeError("injected fault")
        os.kill(os.getpid(), 9)
    loss = model(torch.randn(64, 256)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    if rank == 0:
        torch.save({"model": model.module.state_dict(), "step": step}, snapshot + ".tmp")
        os.replace(snapshot + ".tmp", snapshot)
        print("STEP", step, os.environ["TORCHELASTIC_RESTART_COUNT"], time.time(), flush=True)
dist.destroy_process_group()
"""


def _fault_to_first_step(text: str) -> float:
    """Seconds from the fault to the first step RANK 0 finished after the restart (restart
    count 1: a step of the faulted run may end after the fault, before the others see it)."""
    fault = float(re.findall(r"FAULT ([0-9.]+)", text)[0])
    return min(float(t) for t in re.findall(r"STEP \d+ 1 ([0-9.]+)", text)) - fault


def _run(cmd: list[str], env: dict[str, str]) -> float | str:
    """Seconds from the fault to the first step after the restart, or why the run failed (a
    failed restart is a result: torchrun's new processes can fail to connect, seen here)."""
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    text = out.stdout + out.stderr
    if out.returncode != 0 or "FAULT" not in text:
        errors = [line for line in text.splitlines() if "Error" in line and "Traceback" not in line]
        return f"exit {out.returncode}: {(errors or ['no error line'])[-1].strip()[:200]}"
    return round(_fault_to_first_step(text), 3)


def _commands(script: Path, work: Path, a: argparse.Namespace) -> dict[str, list[str]]:
    args = [str(script), str(a.steps), str(a.fault_step), a.fault, str(work)]
    ours_nproc = a.nproc + (1 if a.fault == "kill" else 0)  # one warm reserve takes the place
    return {
        "torchrun": [
            *(sys.executable, "-m", "torch.distributed.run", "--standalone"),
            *("--nproc-per-node", str(a.nproc), "--max-restarts", "1", *args),
        ],
        "ours": [
            *(sys.executable, "-m", "restartable.launch"),
            *("--nproc-per-node", str(ours_nproc), *args),
        ],
    }


def compare(a: argparse.Namespace) -> dict[str, object]:
    """Alternate torchrun and our launcher ``a.repeats`` times each."""
    config = {"soft_timeout": 10.0, "hard_timeout": 20.0, "active_world_size": a.nproc}
    env = {**os.environ, "PYTHONPATH": str(REPO), "INPROCESS_RESTART_CONFIG": json.dumps(config)}
    env.pop("OMP_NUM_THREADS", None)  # each launcher's own default
    took: dict[str, list[float]] = {"torchrun": [], "ours": []}
    failed: dict[str, list[str]] = {"torchrun": [], "ours": []}
    with tempfile.TemporaryDirectory() as d:
        script = Path(d) / "train.py"
        script.write_text(SCRIPT)
        for i in range(a.repeats):
            for name in ("torchrun", "ours"):
                work = Path(d) / f"{name}{i}"
                work.mkdir()
                got = _run(_commands(script, work, a)[name], env)
                if isinstance(got, float):
                    took[name].append(got)
                else:
                    failed[name].append(got)
    med = {k: statistics.median(v) for k, v in took.items() if v}
    return {
        "fault": a.fault,
        "fault_to_first_step_s": took,
        "failed_runs": failed,
        "median_s": {k: round(v, 3) for k, v in med.items()},
        "ratio_ours_over_torchrun": round(med["ours"] / med["torchrun"], 3)
        if len(med) == 2
        else None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="runs of each launcher")
    p.add_argument("--nproc", type=int, default=2, help="ranks that train")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--fault-step", type=int, default=10)
    p.add_argument("--fault", choices=("raise", "kill"), default="raise")
    a = p.parse_args()
    t0 = time.monotonic()
    result: dict[str, object] = {"load_avg": os.getloadavg()[0], **compare(a)}
    result["load_avg_after"] = os.getloadavg()[0]
    result["wall_s"] = round(time.monotonic() - t0, 1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
