"""The price of protection: the step time with each layer of the framework switched on in turn.

Runs ``benchmarks/step_overhead_job.py`` (the example's tiny GPT under DDP, same ranks, same
seed) once per configuration, in rounds (every configuration once per round, so a slow spell of
the machine hits all of them alike), all in this one invocation:

    plain DDP under torchrun             the second reference
    layers 0..7 under inprocess.launch   plain DDP, + @restartable, + a warm reserve, + re-run
                                         validation, + local tier in memory, + node-local
                                         directory, + persistent every N, + run journal

Prints one JSON document: per configuration the median step (median over rounds of each run's
median step after warm-up), its ratio to the plain step under our launcher, and where the CPU
went while the steps were timed: each thread and child process of each rank as a share of one
core (from /proc, ``core_share``), the waiting reserve's included, so every millisecond has an
owner. ``copy_floor_ms`` is the time of one host-memory copy of the trained state (the least a
per-step local save can cost), and ``copy_floor_ratio`` the step ratio that copy alone would give
(1 + floor / plain step): the local tier's layer compares with it.

    python benchmarks/step_overhead.py                 # 3 rounds x 9 configurations, ~5 min
    python benchmarks/step_overhead.py --quick         # 1 round, fewer steps
    python benchmarks/step_overhead.py --layers 0 1 2  # some configurations only
    python benchmarks/step_overhead.py --parallel fsdp # the same GPT sharded with FSDP2
    python benchmarks/step_overhead.py --paired 10 --layers 0 4 5 6 7
    python benchmarks/step_overhead.py --local-dir /dev/shm  # the node-local directory on tmpfs

``--paired K``: in the configurations that checkpoint (layers 4+), the job saves in blocks of K
steps alternating with blocks of K steps that do not, and ``paired`` reports the median step
with and without saves *in the same job* and their difference (``cost_ms``, and ``cost_ratio``
= 1 + cost / plain step). On a machine whose speed drifts between runs (this project's 2-core
VM: one configuration's rounds spread over 20-40 %), that difference is the saves' cost free of
the drift; ``median_step_ms`` is then over the steps that saved. ``paired.cpu_cost_ms`` says who
pays that cost: per rank, each thread's and child process's CPU per step in the blocks that
saved minus in those that did not (ms, from the scheduler's run time of each thread; rank 0
also counts the launcher, which hosts the store), so that the saves' cost is accounted per
thread and process in the same job that times it.
"""

from __future__ import annotations

import argparse
import contextlib
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
sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_overhead_job import LAYERS  # noqa: E402

JOB = ROOT / "benchmarks" / "step_overhead_job.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def command(config: str, args: argparse.Namespace, out: Path) -> list[str]:
    """The command line of one configuration: ``torchrun`` or ``L<k>`` (layers 0..k)."""
    job = [
        str(JOB),
        "--active",
        str(args.active),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--persistent-every",
        str(args.persistent_every),
        "--paired-every",
        str(args.paired),
        "--parallel",
        args.parallel,
        "--out",
        str(out),
    ]
    if config == "torchrun":
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(args.active),
            "--master-port",
            str(_free_port()),
            *job,
            "--layers",
            "0",
        ]
    layers = int(config[1:])
    nproc = args.active + (1 if layers >= 2 else 0)  # layer 2 adds the waiting reserve
    return [
        sys.executable,
        "-m",
        "restartable.launch",
        "--nproc-per-node",
        str(nproc),
        "--master-port",
        str(_free_port()),
        *job,
        "--layers",
        str(layers),
    ]


def run_once(config: str, args: argparse.Namespace) -> dict[str, Any]:
    """One run of one configuration: its median step and its CPU accounting."""
    with contextlib.ExitStack() as stack:
        out = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="step-overhead-")))
        if args.local_dir is not None:  # the node-local directory of layers 5+ goes there
            local = stack.enter_context(
                tempfile.TemporaryDirectory(prefix="step-overhead-", dir=args.local_dir)
            )
            (out / "local").symlink_to(local)
        env = {k: v for k, v in os.environ.items() if k != "RESTARTABLE_JOURNAL_DIR"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        proc = subprocess.run(
            command(config, args, out),
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=args.timeout,
        )
        if proc.returncode != 0 or not (out / "steps.json").exists():
            raise RuntimeError(f"{config} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        steps = json.loads((out / "steps.json").read_text())
        cpu = {}
        for f in sorted(out.glob("cpu-*.json")):
            cpu[f"rank{f.stem.split('-')[1]}"] = json.loads(f.read_text())["core_share"]
        paired_cpu = {
            f"rank{f.stem.split('-')[2]}": json.loads(f.read_text())
            for f in sorted(out.glob("paired-cpu-*.json"))
        }
    marks = steps["saved"]
    with_ = [i for i, saved in enumerate(marks) if saved]
    without = [i for i, saved in enumerate(marks) if not saved]

    def med(key: str, idx: list[int]) -> float:
        return statistics.median(steps[key][i] for i in idx) * 1e3

    timed = with_ or without  # every step when none saved (layers 0-3)
    run = {"median_ms": med("times", timed), "main_cpu_ms": med("cpu", timed), "cpu": cpu}
    if with_ and without:
        run["paired"] = {
            "with_ms": med("times", with_),
            "without_ms": med("times", without),
            "main_cpu_with_ms": med("cpu", with_),
            "main_cpu_without_ms": med("cpu", without),
            "cpu_cost_ms": paired_cpu,
        }
    return run


def copy_floor_ms() -> float:
    """One host-memory copy of the example's model + AdamW state (the local tier's floor)."""
    import torch

    sys.path.insert(0, str(ROOT / "examples"))
    from gpt import GPTConfig, build_model

    torch.set_num_threads(1)
    model = build_model(GPTConfig(), 0)
    opt = torch.optim.AdamW(model.parameters())
    model(*[torch.zeros(1, 8, dtype=torch.long)] * 2).backward()
    opt.step()
    tensors = [p.detach() for p in model.parameters()]
    tensors += [v for st in opt.state.values() for v in st.values() if v.dim() > 0]
    dst = [torch.empty_like(t) for t in tensors]
    samples = []
    for _ in range(50):
        t0 = time.perf_counter()
        for d, s in zip(dst, tensors, strict=True):
            d.copy_(s)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e3


def _median_by_name(
    runs: list[dict[str, dict[str, float]]], least: float
) -> dict[str, dict[str, float]]:
    """Per rank and name, the median over rounds (0 where a round lacks it), rounded; only what
    is at least `least` in size, and the process total: an idle thread clutters the table."""
    out: dict[str, dict[str, float]] = {}
    for proc in sorted({p for r in runs for p in r}):
        names = sorted({n for r in runs for n in r.get(proc, {})})
        med = {n: round(statistics.median(r.get(proc, {}).get(n, 0.0) for r in runs), 4)
               for n in names}  # fmt: skip
        out[proc] = {n: v for n, v in med.items() if abs(v) >= least or n == "process total"}
    return out


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median over rounds of the step, and of each CPU share (rounded for reading)."""
    cpu = _median_by_name([r["cpu"] for r in runs], least=0.001)
    out = {
        "median_step_ms": round(statistics.median(r["median_ms"] for r in runs), 3),
        "per_round_ms": [round(r["median_ms"], 3) for r in runs],
        "main_thread_cpu_ms": round(statistics.median(r["main_cpu_ms"] for r in runs), 3),
        "core_share": cpu,
    }
    pairs = [r["paired"] for r in runs if "paired" in r]
    if pairs:

        def med(f: Any) -> float:
            return round(statistics.median(f(p) for p in pairs), 3)

        out["paired"] = {
            "with_ms": med(lambda p: p["with_ms"]),
            "without_ms": med(lambda p: p["without_ms"]),
            # per round, then the median: each difference is within one job
            "cost_ms": med(lambda p: p["with_ms"] - p["without_ms"]),
            "per_round_cost_ms": [round(p["with_ms"] - p["without_ms"], 3) for p in pairs],
            "main_cpu_cost_ms": med(lambda p: p["main_cpu_with_ms"] - p["main_cpu_without_ms"]),
            "cpu_cost_ms": _median_by_name([p["cpu_cost_ms"] for p in pairs], least=0.01),
        }
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--active", type=int, default=2)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument("--persistent-every", type=int, default=50)
    p.add_argument("--layers", type=int, nargs="*", default=list(range(len(LAYERS))))
    p.add_argument("--no-torchrun", action="store_true")
    p.add_argument(
        "--paired",
        type=int,
        default=0,
        metavar="K",
        help="layers 4+ save in blocks of K steps alternating with K without (see above)",
    )
    p.add_argument(
        "--local-dir",
        type=Path,
        default=None,
        help="where layers 5+ keep the node-local directory (default: beside the run's files, "
        "on the disk; e.g. /dev/shm for a tmpfs)",
    )
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--quick", action="store_true", help="1 round of 150 steps")
    p.add_argument(
        "--parallel",
        choices=("ddp", "fsdp"),
        default="ddp",
        help="the model replicated (DDP) or sharded with FSDP2 (examples/parallel.py)",
    )
    args = p.parse_args()
    if args.quick:
        args.rounds, args.steps, args.warmup = 1, 150, 30
    configs = [f"L{k}" for k in args.layers] + ([] if args.no_torchrun else ["torchrun"])
    results: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    for i in range(args.rounds):
        for c in configs:
            results[c].append(run_once(c, args))
            print(
                f"round {i + 1}/{args.rounds} {c}: {results[c][-1]['median_ms']:.2f} ms",
                file=sys.stderr,
                flush=True,
            )
    summary = {c: summarize(r) for c, r in results.items()}
    base = summary["L0"]["median_step_ms"] if "L0" in summary else None
    table = {}
    for c, s in summary.items():
        label = "plain DDP under torchrun" if c == "torchrun" else LAYERS[int(c[1:])]
        ratio = None if base is None else round(s["median_step_ms"] / base, 3)
        table[c] = {"what": label, "ratio_to_plain": ratio, **s}
        if "paired" in s and base is not None:
            s["paired"]["cost_ratio"] = round(1 + s["paired"]["cost_ms"] / base, 3)
    floor = copy_floor_ms()
    print(
        json.dumps(
            {
                "active_ranks": args.active,
                "parallel": args.parallel,
                "steps": args.steps,
                "warmup": args.warmup,
                "rounds": args.rounds,
                "paired": args.paired,
                "local_dir": None if args.local_dir is None else str(args.local_dir),
                "load_avg_after": os.getloadavg()[0],
                "copy_floor_ms": round(floor, 3),
                # The least a per-step local save can add, as a ratio: 1 + floor / plain step.
                "copy_floor_ratio": None if base is None else round(1 + floor / base, 4),
                "configs": table,
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
