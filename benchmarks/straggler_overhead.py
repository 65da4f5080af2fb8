"""Per-step overhead of the straggler detector on a small model, in one process.

Run: ``python benchmarks/straggler_overhead.py [--quick] [--device cpu|cuda]``. Prints one JSON
document. Two variants of the same training step run interleaved in rounds, so that machine
noise hits both alike: without a detector (baseline) and inside ``det.section("step")`` followed
by ``det.report_if_due(step)`` with ``profiling_interval=1`` and a report every ``--interval``
seconds (through a real TCPStore, as in a job). Reported: the median per-step time (wall and
process CPU) of each and their ratios (target: overhead <= 1 %). As that difference drowns in
noise on a shared machine, the detector's own cost per step is also measured directly (section
+ report_if_due around an empty step, best of 5) and given as a share of the baseline step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled
from restartable.straggler import Detector


class Step:
    """One training step of a small MLP (forward, backward, AdamW)."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        torch.manual_seed(0)
        layers: list[torch.nn.Module] = []
        for _ in range(args.depth):
            layers += [torch.nn.Linear(args.width, args.width), torch.nn.GELU()]
        self.model = torch.nn.Sequential(*layers).to(device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.x = torch.randn(args.batch, args.width, device=device)
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def __call__(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        self.model(self.x).square().mean().backward()
        self.opt.step()


def detector(interval: float) -> tuple[Detector, Any]:
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    return Detector(store=store, rank=0, world_size=1, report_time_interval=interval), store


def timed_block(step: Step, det: Detector | None, start: int, n: int) -> list[tuple[float, float]]:
    """(wall, process CPU) seconds of each of ``n`` steps. CPU time is the steadier of the two
    on a shared machine: another process's load stretches wall time, hardly this one's CPU."""
    times = []
    for i in range(start, start + n):
        t0, c0 = time.perf_counter(), time.process_time()
        if det is None:
            step()
        else:
            with det.section("step"):
                step()
            det.report_if_due(i)
        step.sync()
        times.append((time.perf_counter() - t0, time.process_time() - c0))
    return times


def own_cost(n: int) -> float:
    """Seconds per step that section + report_if_due add around an empty step (best of 5)."""
    det, _store = detector(3600.0)
    best = float("inf")
    step = 0
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            with det.section("step"):
                pass
            det.report_if_due(step)
            step += 1
        t_det = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(n):
            step += 1
        t_empty = time.perf_counter() - t0
        best = min(best, (t_det - t_empty) / n)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--steps-per-round", type=int, default=50)
    p.add_argument("--interval", type=float, default=1.0, help="report_time_interval (s)")
    args = p.parse_args()
    if args.quick:
        args.rounds, args.steps_per_round = 4, 20
    torch.set_num_threads(1)  # one core per rank, as in the tests; less noise
    device = torch.device(args.device)
    step = Step(args, device)
    det, _store = detector(args.interval)
    timed_block(step, None, 0, 10)  # warm-up (allocator, kernels)
    base: list[tuple[float, float]] = []
    with_det: list[tuple[float, float]] = []
    i = 0
    for r in range(args.rounds):
        order = (None, det) if r % 2 == 0 else (det, None)
        for d in order:
            times = timed_block(step, d, i, args.steps_per_round)
            i += args.steps_per_round
            (base if d is None else with_det).extend(times)
    b = statistics.median(t for t, _ in base)
    w = statistics.median(t for t, _ in with_det)
    b_cpu = statistics.median(c for _, c in base)
    w_cpu = statistics.median(c for _, c in with_det)
    cost = own_cost(2000 if not args.quick else 200)
    reports = det.last_report.round if det.last_report is not None else 0
    print(
        json.dumps(
            {
                "benchmark": "straggler_overhead",
                "device": args.device,
                "model": {"width": args.width, "depth": args.depth, "batch": args.batch},
                "steps_each": len(base),
                "report_time_interval_s": args.interval,
                "rounds_run": reports,
                "baseline_step_ms": round(b * 1e3, 4),
                "detector_step_ms": round(w * 1e3, 4),
                "ratio_detector_to_baseline": round(w / b, 4),
                "overhead_pct": round((w / b - 1) * 100, 2),
                "baseline_step_cpu_ms": round(b_cpu * 1e3, 4),
                "detector_step_cpu_ms": round(w_cpu * 1e3, 4),
                "cpu_ratio_detector_to_baseline": round(w_cpu / b_cpu, 4),
                "cpu_overhead_pct": round((w_cpu / b_cpu - 1) * 100, 2),
                "detector_own_cost_us_per_step": round(cost * 1e6, 2),
                "detector_own_cost_pct_of_step": round(cost / b * 100, 3),
                "target_overhead_pct": 1.0,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
