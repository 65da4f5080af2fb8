"""The usual alternative to restartable, for benchmarks/goodput.py: torchrun + synchronous DCP.

Same model, data and fault plan as ``examples/train.py``, but no in-process restart: every
fault ends the worker processes, ``torchrun --max-restarts=K`` starts new ones, and they resume
from the last checkpoint written with synchronous ``torch.distributed.checkpoint.save`` every
``--persistent-every`` steps. Hangs end when the gloo collective timeout (set to the same value
as our soft timeout) fires; NaN losses crash the step (no re-run machinery).

Measured as restartable is: each worker opens restartable's run journal itself
(``RUN_DIR/journal/<torchrun run id>``, every restart of the group in it) and records there what
``@restartable`` records (job start and end, each attempt as an iteration, steps, faults,
restarts, saves, restores); rank 0 writes ``inprocess.report``'s report of it to
``RUN_DIR/report.json``, so both stacks' terms come from the same code
(``inprocess.report.downtime``).

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
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt import GPTConfig, batch, build_model, corpus
from torchrun_group import attempt_store

from restartable.inprocess import faults, journal
from restartable.inprocess.faults.kinds import InjectedFault
from restartable.inprocess.report.cli import format_report, reports


def latest_step(ckpt_root: Path) -> int | None:
    committed = [
        int(p.name.split("_")[1]) for p in ckpt_root.glob("step_*") if (p / "DONE").exists()
    ]
    return max(committed, default=None)


def restart_cause(run_dir: Path, attempt: int) -> tuple[str, list[int]]:
    """What ended the previous torchrun attempt, as ``@restartable``'s restart record says it:
    the fault injected in it (``"<kind> on rank <r>"``), or ``"relaunch"`` when none fired."""
    last = [f for f in faults.fired(run_dir) if f.iteration == attempt - 1]
    if not last:
        return "relaunch", []
    return f"{last[0].kind} on rank {last[0].rank}", sorted({f.rank for f in last})


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


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
    rank = int(os.environ["RANK"])
    # One journal directory per torchrun run, all its restarts in it: one launch to report on.
    journal_dir = args.run_dir / "journal" / os.environ.get("TORCHELASTIC_RUN_ID", "run")
    jnl = journal.open_journal(journal_dir, rank=rank)
    try:
        return train(args, rank, journal_dir, jnl)
    except BaseException as e:
        # What @restartable records of a fault: this rank's own (an injected exception or NaN),
        # or a failed collective (a peer died, hung or raised), which is not this rank's fault.
        journal.record(
            "fault",
            kind="exception",
            fault_rank=rank,
            exc_type=type(e).__name__,
            detail=str(e)[:200],
            in_collective=not isinstance(e, InjectedFault),
        )
        raise
    finally:
        jnl.close()


def train(args: argparse.Namespace, rank: int, journal_dir: Path, jnl: journal.Journal) -> int:
    world_size = int(os.environ["WORLD_SIZE"])
    restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    journal.record("job_start", world_size=world_size, node=0)
    # Connecting waits for the slowest process to start (seconds here after a relaunch); only
    # collectives get the short timeout that ends a hang, as generous to this stack as we can be.
    store, attempt = attempt_store(timeout=120.0)
    assert attempt == restart_count, (attempt, restart_count)
    dist.init_process_group(
        "gloo",
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=120),
    )
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=args.soft_timeout))
    # Each torchrun attempt is an iteration: @restartable's records, written the same way.
    jnl.set_position(iteration=restart_count, training_rank=rank)
    if restart_count > 0:
        cause, faulting = restart_cause(args.run_dir, restart_count)
        journal.record(
            "restart", iteration=restart_count, cause=cause, faulting_ranks=faulting, phases={}
        )
    journal.record("iteration_start", iteration=restart_count, active=True)
    plan = [f for f in faults.parse_plan(args.faults, steps=args.steps) if f.rank == rank]

    cfg = GPTConfig()
    data = corpus()
    model = build_model(cfg, args.seed)
    ddp = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    ckpt_root = args.run_dir / "ckpt"
    t0 = time.perf_counter()
    start = latest_step(ckpt_root) or 0
    if start:
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(ckpt_root / f"step_{start}"))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        journal.record("restore", step=start, tier="persistent", seconds=time.perf_counter() - t0)

    loss = torch.tensor(float("nan"))
    for step in range(start, args.steps):
        journal.record("step", step=step)  # what ctx.ping(step) records
        for fault in (f for f in plan if f.step == step):
            # Recorded once per run (and journalled as fault_fired), then fired; a due NaN
            # comes back: with no re-run machine under torchrun it is a restart, like an
            # exception.
            due = faults.trigger(
                fault,
                record_dir=args.run_dir,
                initial_rank=rank,
                iteration=restart_count,
                step=step,
            )
            if due:
                raise InjectedFault(f"injected fault {fault.name}")
        opt.zero_grad(set_to_none=True)
        x, y = batch(
            data, seed=args.seed, step=step, rank=rank, batch_size=args.batch_size, seq=cfg.seq
        )
        loss = ddp(x, y)
        loss.backward()
        opt.step()
        if (step + 1) % args.persistent_every == 0:
            t_save = time.perf_counter()
            model_sd, optim_sd = get_state_dict(model, opt)
            path = ckpt_root / f"step_{step + 1}"
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))
            dist.barrier()
            if rank == 0:
                (path / "DONE").touch()
            stall = time.perf_counter() - t_save  # synchronous: the whole save is a stall
            journal.record("save", step=step + 1, tiers=["persistent"], stall_s=stall)
            if rank == 0:
                journal.record(
                    "save_durable",
                    step=step + 1,
                    write_s=stall,
                    bytes=dir_bytes(path),
                    path=str(path),
                )

    dist.barrier()
    dist.destroy_process_group()
    journal.record("job_end", outcome="done", iterations=restart_count + 1)
    if rank == 0:
        write_report(journal_dir, args.run_dir, steps=args.steps, loss=loss.item())
    return 0


def write_report(journal_dir: Path, run_dir: Path, *, steps: int, loss: float) -> None:
    """The example's report.json, from this run's journal: the same terms as restartable's."""
    rep = reports(journal_dir)[-1]
    out: dict[str, Any] = {**rep.as_dict(), "final_step": steps, "final_loss": loss}
    (run_dir / "report.json").write_text(json.dumps(out, indent=2))
    print(format_report(rep), flush=True)


if __name__ == "__main__":
    sys.exit(main())
