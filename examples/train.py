"""Train a tiny byte-level GPT with DDP through injected faults, then report the downtime.

Run (4 ranks on this machine's CPU, 5 faults, about 30 s on 2 cores):

    python -m inprocess.launch --nproc-per-node 4 examples/train.py --faults demo

It uses all three packages: ``@restartable`` re-runs ``train()`` in place after a fault (warm
reserves replace lost ranks), ``CheckpointManager`` keeps a host-memory copy every step and a
torch_dist checkpoint every ``--persistent-every`` steps, and ``RerunStateMachine`` re-runs a step
whose loss is NaN or spiky. At the end one rank prints the downtime report and writes it to
``RUN_DIR/report.json`` (and a PNG timeline with ``--report-png``).

The console shows the story (each fault, each restart, progress, the report); every rank's
details go to ``RUN_DIR/logs/<launch>/rank<N>.log``. SIGTERM (forwarded by the launcher, or sent
by Slurm before the time limit) makes every rank finish its step, write a persistent checkpoint
and exit with status 75; the next launch with the same ``--run-dir`` resumes from that step. A
finished run is not redone: ``--fresh`` starts over in the same directory.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rundir
import story

from inprocess import RestartRecord, faults  # torch-free: --help answers without importing torch

log = logging.getLogger("train")


class UsageError(ValueError):
    """A bad command line: printed as one line by one rank, exit status 2."""


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # Every rank parses the same command line: one line per node, not one per rank.
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            self.exit(2, f"{self.prog}: error: {message} (--help lists the options)\n")
        self.exit(2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = _Parser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    p.add_argument("--faults", default="demo", help=faults.plan_help() + "\n(default: demo)")
    p.add_argument(
        "--active",
        type=_positive,
        default=None,
        help="ranks running train(); the rest wait as warm reserves\n"
        "(default: one reserve per fault that loses its rank)",
    )
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument(
        "--run-dir",
        type=Path,
        default=Path("runs/example"),
        help="checkpoints, fault records, report and logs (default runs/example); an unfinished\n"
        "run there is resumed, a finished one is not redone",
    )
    p.add_argument("--fresh", action="store_true", help="start over in RUN_DIR (clears its run)")
    p.add_argument("--persistent-every", type=int, default=50)
    p.add_argument(
        "--local-dir",
        default=None,
        help="node-local checkpoint dir (default: RUN_DIR/local/<launch>; 'none': memory only)",
    )
    p.add_argument("--soft-timeout", type=float, default=2.0)
    p.add_argument("--hard-timeout", type=float, default=5.0)
    p.add_argument("--report-png", type=Path, default=None)
    p.add_argument("--log-every", type=_positive, default=50, help="progress line every N steps")
    p.add_argument("--debug", action="store_true", help="tracebacks and every log on the console")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)  # before torch's 2-3 s import: --help and bad flags answer at once
    from checkpoint import CheckpointConfigError, CheckpointStorageError
    from inprocess.errors import ConfigError

    try:
        return run(args)
    except (UsageError, ConfigError, CheckpointConfigError, CheckpointStorageError) as e:
        # Bad input, whichever layer found it: one line, no traceback (--debug shows it).
        if args.debug:
            raise
        # Every rank finds the same bad input: one line per node, not one per rank.
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            print(f"train.py: error: {e}", file=sys.stderr, flush=True)
        return 2


def run(args: argparse.Namespace) -> int:
    import torch
    from gpt import GPTConfig, batch, build_model, corpus
    from report import EventLog, build_report, format_report, write_png
    from state import TrainState
    from torch.nn.parallel import DistributedDataParallel as DDP

    from checkpoint import CheckpointManager
    from inprocess import context, restartable
    from inprocess.preemption import PREEMPTED_EXIT_CODE, PreemptionHandler
    from rerun import RerunDataIterator, RerunStateMachine

    torch.set_num_threads(1)  # 4 ranks on 2 cores: more threads only contend
    world = int(os.environ.get("WORLD_SIZE", "1"))
    initial_rank = int(os.environ.get("RANK", "0"))
    launch = rundir.launch_id()
    # One warm reserve per fault that loses its rank; then the plan is checked against the
    # ranks that train (a fault on a rank that never trains would silently never fire).
    try:
        losing = sum(f.loses_rank for f in faults.parse_plan(args.faults, steps=args.steps))
        active = args.active or max(1, world - losing)
        plan = faults.parse_plan(args.faults, steps=args.steps, world_size=active)
    except ValueError as e:
        raise UsageError(f"--faults: {e}") from None
    if active > world:
        raise UsageError(
            f"--active ({active}) must be <= the number of processes ({world}): lower --active "
            "or start more processes (--nproc-per-node)"
        )
    if args.local_dir not in (None, "none") and not Path(args.local_dir).is_dir():
        raise UsageError(
            f"--local-dir ({args.local_dir}) is not a directory: create it, or pass "
            "--local-dir none to keep the local tier in memory only"
        )
    run_dir = args.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    done = rundir.finished(run_dir)
    if not args.fresh and done is not None and done["steps"] >= args.steps:
        if initial_rank == 0:
            print(
                f"{run_dir} holds a finished {done['steps']}-step run (report: "
                f"{run_dir / 'report.json'}): nothing to do. Add --fresh to start over there, "
                "or pass --run-dir NEW_DIR.",
                flush=True,
            )
        return 0
    if args.fresh:
        rundir.start_fresh(run_dir, initial_rank=initial_rank, launch=launch)
    log_file = story.configure(run_dir / "logs" / launch, rank=initial_rank, debug=args.debug)
    if initial_rank == 0:
        log.info("details of every rank: %s", log_file.parent)
    # One event directory per launch (a resumed run is a new launch with the same run dir).
    events_dir = run_dir / "events" / launch
    events = EventLog(events_dir, initial_rank)
    events.emit("start")
    data = corpus()
    cfg = GPTConfig()

    # The node-local copy lets a reserve that replaces a killed rank on the same machine restore
    # that rank's shard without a peer on another node; one directory per launch, so a later
    # launch never restores a stale local step.
    local_dir = None if args.local_dir == "none" else args.local_dir
    if args.local_dir is None:
        local_dir = str(run_dir / "local" / launch)
        Path(local_dir).mkdir(parents=True, exist_ok=True)
    mgr = CheckpointManager(
        str(run_dir / "ckpt"),
        persistent_every=args.persistent_every,
        keep=2,
        local_every=1,
        local_dir=local_dir,
        # A replica on another node survives that node's loss; on one node there is none to make.
        replication_factor=2 if world > int(os.environ.get("LOCAL_WORLD_SIZE", world)) else 1,
    )

    @restartable(
        soft_timeout=args.soft_timeout,
        hard_timeout=args.hard_timeout,
        heartbeat_interval=0.5,
        active_world_size=active,
        granularity="rank",
    )
    def train(preempt: PreemptionHandler) -> dict[str, Any]:
        ctx = context()
        events.emit("enter", iteration=ctx.iteration, rank=ctx.rank, restart=_restart_phases(ctx))
        # Built afresh in every iteration: whatever a fault left half-done is dropped, and the
        # state comes back from the checkpoint (the manager outlives iterations, the rest not).
        # in_job: a result that needs other hardware to judge hands this rank's work to a warm
        # reserve inside the job (RerunExit with a rank action) instead of exiting with code 16.
        rsm = RerunStateMachine(
            mode="validate_results",
            check_for_nan_in_loss=True,
            check_for_spiky_loss=True,
            in_job=True,
            # On a CPU host every rank shares the "cpu" device: the process is the hardware.
            hardware_id=None if torch.cuda.is_available() else f"cpu-rank{ctx.initial_rank}",
        )
        model = build_model(cfg, args.seed)
        ddp = DDP(model)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        state = TrainState(model, opt, rsm, ctx.rank)
        ckpt = {"train": state}

        t0 = time.monotonic()
        restored = mgr.load_latest(ckpt)
        restore = mgr.last_restore
        start = state.step if restored is not None else 0
        events.emit(
            "restored",
            iteration=ctx.iteration,
            rank=ctx.rank,
            step=start,
            tier=getattr(restore, "tier", None),
            seconds=time.monotonic() - t0,
        )
        if ctx.rank == 0:
            _tell_restart(ctx.last_restart, run_dir, restored, restore, time.monotonic() - t0)
        loss = torch.tensor(float("nan"))
        tick, tick_step = time.monotonic(), start
        for step in range(start, args.steps):
            t_step = time.monotonic()
            ctx.ping(step)  # the step lets the wrapper spot the same fault repeating at a step
            # Fires this rank's planned faults once per run, each recorded in the run dir first
            # (the report times them); a due NaN comes back for the loss of the first attempt.
            nan_due = faults.fire_planned(plan, step=step, record_dir=run_dir)
            batches = RerunDataIterator(
                iter(
                    [
                        batch(
                            data,
                            seed=args.seed,
                            step=step,
                            rank=ctx.rank,
                            batch_size=args.batch_size,
                            seq=cfg.seq,
                        )
                    ]
                )
            )
            attempts = 0
            t_detect = 0.0
            while rsm.should_run_forward_backward(batches):
                attempts += 1
                opt.zero_grad(set_to_none=True)
                x, y = next(batches)
                loss = ddp(x, y)
                if nan_due is not None and attempts == 1:
                    loss = loss * float("nan")  # a transient numerical fault on this rank
                loss.backward()
                t_check = time.monotonic()
                rsm.validate_loss(loss)
                t_detect = time.monotonic() - t_check
            if attempts > 1:
                events.emit(
                    "rerun",
                    step=step,
                    rank=ctx.rank,
                    attempts=attempts,
                    detect_s=t_detect,
                    rerun_s=time.monotonic() - t_step,
                    verdict=rsm.verdict.value if rsm.verdict is not None else None,
                )
            _, exit_now, _ = rsm.should_checkpoint_and_exit()
            if exit_now:  # a verdict that needs other hardware or a person: see rerun/README
                rsm.exit_or_raise()
            opt.step()
            state.step = step + 1
            stop = preempt.should_stop()
            t_save = time.monotonic()
            mgr.save(state.step, ckpt, force_persistent=stop)
            events.emit("save", step=state.step, rank=ctx.rank, stall=time.monotonic() - t_save)
            events.emit(
                "step",
                step=step,
                rank=ctx.rank,
                loss=loss.item(),
                seconds=time.monotonic() - t_step,
            )
            if ctx.rank == 0 and (step + 1) % args.log_every == 0:
                rate = (step + 1 - tick_step) / (time.monotonic() - tick)
                tick, tick_step = time.monotonic(), step + 1
                print(
                    f"step {step + 1:5d}  loss {loss.item():.4f}  {rate:6.1f} steps/s", flush=True
                )
            if stop:
                mgr.wait()
                return {
                    "step": state.step,
                    "loss": loss.item(),
                    "preempted": True,
                    "rank": ctx.rank,
                }
        mgr.wait()
        return {"step": state.step, "loss": loss.item(), "preempted": False, "rank": ctx.rank}

    try:
        with PreemptionHandler(exit_signal=signal.SIGTERM) as preempt:
            result = train(preempt)
    finally:
        # Also when train() stops for good (RestartAbortedError): a save still in flight is
        # abandoned here, instead of holding the interpreter's exit until its timeout.
        mgr.close()
    if result is None:  # a reserve that was never needed
        events.close()
        return 0
    events.emit("done", rank=result["rank"], step=result["step"], loss=result["loss"])
    if result["rank"] == 0:
        if not result["preempted"]:
            rundir.mark_finished(run_dir, steps=result["step"], loss=result["loss"])
        fired = [f.as_dict() for f in faults.fired(run_dir)]
        report = build_report(events_dir, faults=fired, wall_end=time.time())
        (run_dir / "report.json").write_text(json.dumps(report, indent=2))
        print(format_report(report), flush=True)
        print(f"report written to {run_dir / 'report.json'}", flush=True)
        if args.report_png is not None:
            write_png(report, args.report_png)
            print(f"timeline written to {args.report_png}", flush=True)
    events.close()
    return PREEMPTED_EXIT_CODE if result["preempted"] else 0


def _tell_restart(
    record: RestartRecord | None, run_dir: Path, step: int | None, restore: Any, reload_s: float
) -> None:
    """The console's line for the restart (or the resume) that led into this train() call."""
    tier = getattr(restore, "tier", None) or "no"
    if record is not None:
        down = sum(record.phases.values()) + reload_s
        log.info(
            "restart %d: %s; back at step %d from the %s tier, %.2f s after the fault",
            record.iteration,
            record.cause,
            step or 0,
            tier,
            down,
        )
    elif step is not None:
        log.info("resuming %s at step %d (%s tier); --fresh starts over", run_dir, step, tier)


def _restart_phases(ctx: Any) -> dict[str, float]:
    """The wrapper's per-phase timings of the restart that led here (seconds)."""
    record = ctx.last_restart
    return {} if record is None else {f"{k}_s": v for k, v in record.phases.items()}


if __name__ == "__main__":
    sys.exit(main())
