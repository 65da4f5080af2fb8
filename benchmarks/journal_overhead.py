"""Per-step cost of the run journal: the same training loop with and without it, one run.

The loop is a small MLP's forward, backward and optimizer step on CPU (one intra-op thread).
Every other step also writes what the framework writes per step (``ctx.ping(step)``: one "step"
record, flushed), so that load from other processes hits both variants alike; the figure is
the ratio of the median step times (target: <= 1.01), plus the cost of one record alone.

    python benchmarks/journal_overhead.py            # 5 rounds x 400 steps per variant
    python benchmarks/journal_overhead.py --quick
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from restartable.inprocess import journal


def _steps(
    n: int, model: torch.nn.Module, opt: torch.optim.Optimizer, *, journal_every_other: bool
) -> tuple[list[float], list[float]]:
    """(plain step times, journaled step times): even steps plain, odd ones journaled."""
    x = torch.randn(64, 256)
    plain, journaled = [], []
    for step in range(n):
        with_record = journal_every_other and step % 2 == 1
        t0 = time.perf_counter()
        if with_record:
            journal.record("step", step=step)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        (journaled if with_record else plain).append(time.perf_counter() - t0)
    return plain, journaled


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.rounds, args.steps = 2, 100
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256)
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    _steps(50, model, opt, journal_every_other=False)  # warm-up
    record_us: list[float] = []
    with tempfile.TemporaryDirectory() as d:
        j = journal.open_journal(d, rank=0)
        try:
            plain, journaled = _steps(
                2 * args.rounds * args.steps, model, opt, journal_every_other=True
            )
            t0 = time.perf_counter()
            for step in range(2000):
                journal.record("step", step=step)
            record_us.append((time.perf_counter() - t0) / 2000 * 1e6)
        finally:
            j.close()
    med_plain, med_j = statistics.median(plain), statistics.median(journaled)
    print(
        json.dumps(
            {
                "benchmark": "journal_overhead",
                "steps_per_variant": len(plain),
                "median_step_ms": {"plain": med_plain * 1e3, "journal": med_j * 1e3},
                "ratio": med_j / med_plain,
                "record_us": record_us[0],
                "target_ratio": 1.01,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
