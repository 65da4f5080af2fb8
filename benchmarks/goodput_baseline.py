"""The usual alternative to restartable, for benchmarks/goodput.py: torchrun + synchronous DCP.

Same model, data, fault plan and event log as ``examples/train.py``, but no in-process restart:
every fault ends the worker processes, ``torchrun --max-restarts=K`` starts new ones, and they
resume from the last checkpoint written with synchronous ``torch.distributed.checkpoint.save``
every ``--persistent-every`` steps. Hangs end when the gloo collective timeout (set to the same
value as our soft timeout) fires; NaN losses crash the step (no re-run machinery).

    torchrun --nproc-per-node 2 --max-restarts 8 benchmarks/goodput_baseline.py --faults demo
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt import GPTConfig, batch, build_model, corpus
from report import EventLog, build_report, format_report
from torchrun_group import attempt_store

from inprocess import faults


def latest_step(ckpt_root: Path) -> int | None:
    committed = [
        int(p.name.split("_")[1]) for p in ckpt_root.glob("step_*") if (p / "DONE").exists()
    ]
    return max(committed, default=None)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--faults", default="demo")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--persistent-every", type=int, default=50)
    p.add_argument("--soft-timeout", type=float, default=2.0)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)

    # Connecting waits for the slowest process to start (seconds here after a relaunch); only
    # collectives get the short timeout that ends a hang, as generous to this stack as we can be.
    store, restart_count = attempt_store(timeout=120.0)
    dist.init_process_group(
        "gloo",
        store=store,
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=datetime.timedelta(seconds=120),
    )
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=args.soft_timeout))
    rank = dist.get_rank()
    events_dir = args.run_dir / "events" / os.environ.get("TORCHELASTIC_RUN_ID", "run")
    events = EventLog(events_dir, rank + 100 * restart_count)
    events.emit("start")
    events.emit("enter", iteration=restart_count, rank=rank, restart={})
    plan = [f for f in faults.parse_plan(args.faults, steps=args.steps) if f.rank == rank]

    cfg = GPTConfig()
    data = corpus()
    model = build_model(cfg, args.seed)
    ddp = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    ckpt_root = args.run_dir / "ckpt"
    t0 = time.monotonic()
    start = latest_step(ckpt_root) or 0
    if start:
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(ckpt_root / f"step_{start}"))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    events.emit(
        "restored",
        iteration=restart_count,
        rank=rank,
        step=start,
        tier="persistent" if start else None,
        seconds=time.monotonic() - t0,
    )

    loss = torch.tensor(float("nan"))
    for step in range(start, args.steps):
        t_step = time.monotonic()
        for fault in (f for f in plan if f.step == step):
            # Recorded once per run, then fired; a due NaN comes back: with no re-run machine
            # under torchrun it is a restart, like an exception.
            due = faults.trigger(
                fault,
                record_dir=args.run_dir,
                initial_rank=rank,
                iteration=restart_count,
                step=step,
            )
            if due:
                raise RuntimeError(f"injected fault {fault.name}")
        opt.zero_grad(set_to_none=True)
        x, y = batch(
            data, seed=args.seed, step=step, rank=rank, batch_size=args.batch_size, seq=cfg.seq
        )
        loss = ddp(x, y)
        loss.backward()
        opt.step()
        if (step + 1) % args.persistent_every == 0:
            t_save = time.monotonic()
            model_sd, optim_sd = get_state_dict(model, opt)
            path = ckpt_root / f"step_{step + 1}"
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))
            dist.barrier()
            if rank == 0:
                (path / "DONE").touch()
            events.emit("save", step=step + 1, rank=rank, stall=time.monotonic() - t_save)
        events.emit(
            "step", step=step, rank=rank, loss=loss.item(), seconds=time.monotonic() - t_step
        )

    events.emit("done", rank=rank, step=args.steps, loss=loss.item())
    dist.barrier()
    if rank == 0:
        fired = [f.as_dict() for f in faults.fired(args.run_dir)]
        report = build_report(events_dir, faults=fired, wall_end=time.time())
        (args.run_dir / "report.json").write_text(json.dumps(report, indent=2))
        print(format_report(report), flush=True)
    dist.destroy_process_group()
    events.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
