"""Training-loop stall, time to durable and background slowdown of persistent checkpoint saves.

A state of ``--size-mib`` in total (default 2 GiB: a few large tensors plus ~4000 small ones),
split evenly over 1 and then 2 ranks (gloo, localhost). In one invocation, per rank count:

* floors: copying the state's bytes into a pre-faulted buffer, and the disk's write bandwidth
  (one large file, 64 MiB writes, fsync);
* ``ours``: ``CheckpointManager.save`` (staging into reused buffers; write in a thread);
* ``dcp_sync``: ``torch.distributed.checkpoint.save``;
* ``dcp_async_thread`` / ``dcp_async_process``: ``dcp.async_save`` with each executor;
* ``torch_save``: ``torch.save`` of each rank's state to its own file + fsync.

For each: blocking time of the call (the training loop's stall), time until durable (the
future / background save finished), and the mean duration of synthetic training steps that
run while the write is in the background, divided by the mean step without any save (one
intra-op thread, so the ratio shows contention for the GIL more than for cores). The
first call of each method (allocations, process start) is reported separately from the median
of the following ones. Prints one JSON document.

    python benchmarks/checkpoint_stall.py            # 2 GiB, 1 and 2 ranks
    python benchmarks/checkpoint_stall.py --quick    # 64 MiB, 2 repeats
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SMALL_BYTES = 16 << 10  # each small tensor (optimizer scalars, norms, biases)
METHODS = ("ours", "dcp_sync", "dcp_async_thread", "dcp_async_process", "torch_save")
ASYNC = {"ours", "dcp_async_thread", "dcp_async_process"}


def _state(nbytes: int, n_small: int, rank: int) -> dict[str, Any]:
    import torch

    small = {f"r{rank}.s{i}": torch.rand(SMALL_BYTES // 4) for i in range(n_small)}
    rest = max(nbytes - n_small * SMALL_BYTES, 4 << 20) // 4 // 4
    # Keys are per rank: every rank owns distinct tensors (no DCP dedup), like a sharded model.
    large = {f"r{rank}.l{i}": torch.rand(rest) for i in range(4)}
    return {"model": {**large, **small}}


def _nbytes(state: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in state["model"].values())


def _train_step(a: Any, b: Any) -> None:
    # Python-level dispatch plus small kernels: what a GIL-bound background thread slows down.
    # About 10 ms on one core: long enough that one GIL hand-off (5 ms switch interval) is
    # not the whole step, short enough to sample a background write many times.
    acc = 0.0
    for _ in range(20):
        acc += float((a @ b).sum())
    del acc


def _steps_while(busy: Any, a: Any, b: Any, limit_s: float) -> list[float]:
    times = []
    end = time.perf_counter() + limit_s
    while busy() and time.perf_counter() < end:
        t0 = time.perf_counter()
        _train_step(a, b)
        times.append(time.perf_counter() - t0)
    return times


def _floors(state: dict[str, Any], workdir: Path, rank: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    tensors = list(state["model"].values())
    dst = [torch.empty_like(t) for t in tensors]
    for d, s in zip(dst, tensors, strict=True):
        d.copy_(s)  # pre-fault
    # Every rank copies (and then writes) at the same moment, as every rank stages (and writes)
    # at once in the measurements these are the floor of: they share memory and disk bandwidth.
    copies = []
    for _ in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        for d, s in zip(dst, tensors, strict=True):
            d.copy_(s)
        copies.append(time.perf_counter() - t0)
    del dst
    nbytes = _nbytes(state)
    buf = memoryview(bytearray(64 << 20))
    path = workdir / f"disk_floor.{rank}"
    dist.barrier()
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            n = min(left, len(buf))
            f.write(buf[:n])
            left -= n
        f.flush()
        os.fsync(f.fileno())
    write_s = time.perf_counter() - t0
    path.unlink()
    return {"copy_s": min(copies), "disk_write_s": write_s, "disk_gib_s": nbytes / 2**30 / write_s}


class _Handle:
    """A save in flight: ``running()`` while its background write is not finished."""

    def __init__(self, running: Any, wait: Any) -> None:
        self.running = running
        self.wait = wait


def _start(method: str, state: Any, target: Path, mgr: Any, step: int, rank: int) -> _Handle:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    done = _Handle(lambda: False, lambda: None)
    if method == "ours":
        mgr.save(step, state)
        return _Handle(lambda: mgr.save_in_flight, mgr.wait)
    if method == "dcp_sync":
        dcp.save(state, checkpoint_id=str(target))
        return done
    if method == "torch_save":
        target.mkdir(parents=True, exist_ok=True)
        with open(target / f"rank{rank}.pt", "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        return done
    kind = {
        "dcp_async_thread": AsyncCheckpointerType.THREAD,
        "dcp_async_process": AsyncCheckpointerType.PROCESS,
    }[method]
    fut = dcp.async_save(state, checkpoint_id=str(target), async_checkpointer_type=kind)
    return _Handle(lambda: not fut.done(), fut.result)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from restartable.checkpoint import CheckpointManager

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    # One intra-op thread: the training step uses one core, leaving the rest to the writers,
    # so the slowdown shows contention for the GIL rather than for cores.
    torch.set_num_threads(1)
    base = Path(args.dir)
    state = _state(args.size_mib * 2**20 // world, args.small // world, rank)
    a, b = torch.rand(256, 256), torch.rand(256, 256)
    floors = _floors(state, base, rank)
    dist.barrier()
    baseline = statistics.fmean(_steps_while(lambda: True, a, b, 1.0))

    mgr = CheckpointManager(str(base / "ours"), persistent_every=1, keep=1)
    results: dict[str, Any] = {}
    for method in args.methods:
        runs = []
        for rep in range(args.repeats):
            # Async methods save twice per repeat: once with the loop idle (time to durable),
            # once with training steps running (their slowdown while the write is in flight).
            run: dict[str, Any] = {}
            for phase in ("idle", "busy") if method in ASYNC else ("idle",):
                t_phase = time.perf_counter()
                target = base / method / f"{rep}-{phase}"
                dist.barrier()
                t0 = time.perf_counter()
                busy = _start(method, state, target, mgr, 2 * rep + (phase == "busy") + 1, rank)
                blocking = time.perf_counter() - t0
                steps = _steps_while(busy.running, a, b, 600.0) if phase == "busy" else []
                busy.wait()
                if phase == "idle":
                    run = {"blocking_s": blocking, "durable_s": time.perf_counter() - t0}
                else:
                    # Mean, not median: throughput is what a stalled step costs.
                    run["slowdown"] = statistics.fmean(steps) / baseline if steps else None
                    run["steps_during_write"] = len(steps)
                    run["durable_busy_s"] = time.perf_counter() - t_phase
                dist.barrier()
                if rank == 0:
                    shutil.rmtree(target, ignore_errors=True)
            run.setdefault("slowdown", None)
            runs.append(run)
        results[method] = runs
    mgr.close()
    out = {"rank": rank, "bytes": _nbytes(state), "floors": floors, "step_s": baseline}
    out["methods"] = results
    Path(args.out).write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    rest = runs[1:] or runs
    slow = [r["slowdown"] for r in runs if r["slowdown"] is not None]
    out: dict[str, Any] = {
        "first_blocking_s": round(runs[0]["blocking_s"], 4),
        "blocking_s": round(statistics.median(r["blocking_s"] for r in rest), 4),
        "durable_s": round(statistics.median(r["durable_s"] for r in rest), 3),
        "slowdown": round(statistics.median(slow), 3) if slow else None,
    }
    busy = [r["durable_busy_s"] for r in runs if "durable_busy_s" in r]
    if busy:  # time to durable while the training steps run: what the write's priority costs
        out["durable_while_training_s"] = round(statistics.median(busy), 3)
    return out


def run_world(world: int, args: argparse.Namespace, base: Path) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs, outs = [], []
    for rank in range(world):
        out = base / f"result.{world}.{rank}.json"
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            PYTHONPATH=str(ROOT),
        )
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            "--out",
            str(out),
            "--dir",
            str(base),
            "--size-mib",
            str(args.size_mib),
            "--small",
            str(args.small),
            "--repeats",
            str(args.repeats),
            "--methods",
            ",".join(args.methods),
        ]
        procs.append(subprocess.Popen(cmd, env=env))
        outs.append(out)
    for p in procs:
        if p.wait(timeout=1800) != 0:
            raise SystemExit(f"benchmark rank exited with {p.returncode}")
    ranks = [json.loads(o.read_text()) for o in outs]
    nbytes = sum(r["bytes"] for r in ranks)
    # The slowest rank decides: a step (or a save) is as slow as its slowest participant.
    copy_s = max(r["floors"]["copy_s"] for r in ranks)
    disk_s = max(r["floors"]["disk_write_s"] for r in ranks)
    methods = {}
    for m in args.methods:
        per_rank = [_summary(r["methods"][m]) for r in ranks]
        methods[m] = {
            k: (max(v) if all(x is not None for x in v) else None)
            for k in per_rank[0]
            for v in [[p[k] for p in per_rank]]
        }
    ours = methods.get("ours", {})
    return {
        "ranks": world,
        "bytes": nbytes,
        "floors": {
            "copy_s": round(copy_s, 4),
            "disk_write_s": round(disk_s, 3),
            "disk_gib_s": round(nbytes / 2**30 / disk_s, 3),
        },
        "methods": methods,
        "ratios": {
            "blocking_vs_copy_floor": round(ours["blocking_s"] / copy_s, 2) if ours else None,
            "durable_vs_disk_floor": round(ours["durable_s"] / disk_s, 2) if ours else None,
            "slowdown_during_write": ours.get("slowdown"),
        },
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="64 MiB, 400 small tensors, 2 repeats")
    p.add_argument("--size-mib", type=int, default=2048)
    p.add_argument("--small", type=int, default=4000, help="small tensors in total")
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--ranks", default="1,2")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.methods = [m for m in args.methods.split(",") if m]
    if args.worker:
        worker(args)
        return
    if args.quick:
        args.size_mib, args.small, args.repeats = 64, 400, 2
    base = Path(args.dir or tempfile.mkdtemp(prefix="ckpt-stall-"))
    try:
        worlds = [run_world(int(w), args, base) for w in args.ranks.split(",")]
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    print(
        json.dumps(
            {
                "benchmark": "checkpoint_stall",
                "size_mib": args.size_mib,
                "small_tensors": args.small,
                "repeats": args.repeats,
                "worlds": worlds,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
