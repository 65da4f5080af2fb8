"""Train a tiny byte-level GPT with DDP, FSDP2, TP or HSDP through injected faults, then report.

Run (4 ranks on this machine's CPU, 5 faults, about 30 s on 2 cores):

    python -m restartable.launch --nproc-per-node 4 examples/train.py --faults demo

``--parallel fsdp|tp|hsdp`` shards the model (FSDP2 ``fully_shard``, tensor parallel, or HSDP on a
2-D mesh; examples/parallel.py) instead of replicating it with DDP; both checkpoint tiers keep the
sharded state. It trains on the CPU over gloo, also on a machine with GPUs. ``--device cuda``
trains on one GPU per rank over NCCL (at most as many processes per node as GPUs; with one GPU e.g.
``--nproc-per-node 1 --faults exception@rank0:step50,nan@rank0:step100,hang@rank0:step150``).

It uses all three packages: ``@restartable`` re-runs ``train()`` in place after a fault (warm
reserves replace lost ranks), ``CheckpointManager`` keeps a host-memory copy every step and a
torch_dist checkpoint every ``--persistent-every`` steps, and ``RerunStateMachine`` re-runs a step
whose loss is NaN or spiky. The framework journals what it does (``RUN_DIR/journal/<launch>/``,
one file per process); at the end rank 0 prints the framework's downtime report of this launch
(``inprocess.report``, the same as ``python -m restartable.inprocess.report
RUN_DIR/journal/<launch>``) and writes it to ``RUN_DIR/report.json`` (and a PNG timeline with
``--report-png``).

The console shows the story (each fault, each restart, progress, the report); every rank's
details go to ``RUN_DIR/logs/<launch>/rank<N>.log``. SIGTERM (forwarded by the launcher, or sent
by Slurm before the time limit) makes every rank finish its step, write a persistent checkpoint
and exit with status 75; the next launch with the same ``--run-dir`` resumes from that step. A
finished run is not redone: ``--fresh`` starts over in the same directory.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rundir
import scrubbing
import story

# torch-free: --help answers without importing torch
from restartable.inprocess import RestartAbortedError, RestartRecord, faults
from restartable.inprocess.journal import read as read_journal
from restartable.inprocess.report import job_view
from restartable.inprocess.report.cli import format_report, plot, reports

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
    # No abbreviations: `--fault demo` was taken as --faults.
    p = _Parser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter, allow_abbrev=False
    )
    p.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    p.add_argument("--faults", default="demo", help=faults.plan_help() + "\n(default: demo)")
    p.add_argument(
        "--active",
        type=_positive,
        default=None,
        help="ranks running train(); the rest wait as warm reserves\n"
        "(default: one reserve per fault that loses its rank)",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: CPU tensors over gloo (default, also where GPUs exist);\n"
        "cuda: one GPU per rank over NCCL",
    )
    p.add_argument(
        "--parallel",
        choices=("ddp", "fsdp", "tp", "hsdp"),
        default="ddp",
        help="ddp: replicate the model (default); fsdp: shard it with FSDP2 (fully_shard);\n"
        "tp: split each block's MLP across the ranks (tensor parallel);\n"
        "hsdp: shard within pairs of ranks, replicate across pairs (2-D mesh)",
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
    p.add_argument(
        "--calculate-timeouts",
        action="store_true",
        help="learn each section's timeout (setup, step, checkpointing) from its durations\n"
        "and keep it in RUN_DIR/ft_state.json: a hang in a step is caught in a few\n"
        "step-times instead of --soft-timeout",
    )
    p.add_argument(
        "--safety-factor",
        type=float,
        default=5.0,
        help="learned timeout = this x the longest duration seen (default 5.0)",
    )
    scrubbing.add_arguments(p)
    p.add_argument("--report-png", type=Path, default=None)
    p.add_argument("--log-every", type=_positive, default=50, help="progress line every N steps")
    p.add_argument("--debug", action="store_true", help="tracebacks and every log on the console")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)  # before torch's 2-3 s import: --help and bad flags answer at once
    from restartable.checkpoint import CheckpointConfigError, CheckpointStorageError
    from restartable.inprocess.errors import ConfigError

    try:
        return run(args)
    except RestartAbortedError as e:
        if args.debug or e.origin != "application":
            raise
        # A bug every rank hits each time: one line for the job, EX_SOFTWARE (never requeued).
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"train.py: application fault: {str(e).splitlines()[0]}", file=sys.stderr)
        return 70
    except (UsageError, ConfigError, CheckpointConfigError, CheckpointStorageError) as e:
        # Bad input, whichever layer found it: one line, no traceback (--debug shows it).
        if args.debug:
            raise
        # Every rank finds the same bad input: one line per node, not one per rank.
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            print(f"train.py: error: {e}", file=sys.stderr, flush=True)
        return 2


def run(args: argparse.Namespace) -> int:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    initial_rank = int(os.environ.get("RANK", "0"))
    launch = rundir.launch_id()
    # One warm reserve per fault that loses its rank; then the plan is checked against the
    # ranks that train (a fault on a rank that never trains would silently never fire).
    try:
        # An sdc fault needs a reserve: to check the steps, and for an `sdc` (a faulty chip) to
        # take the place of the rank scrubbing retires.
        losing = sum(
            f.loses_rank or f.kind.startswith("sdc")
            for f in faults.parse_plan(args.faults, steps=args.steps)
        )
        active = args.active or max(1, world - losing)
        plan = faults.parse_plan(args.faults, steps=args.steps, world_size=active)
        scrubbing.check_plan(plan, args)
    except ValueError as e:
        raise UsageError(f"--faults: {e}") from None
    try:
        scrub_mode = scrubbing.mode(args, world=world, active=active)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if any(f.kind == "slow" for f in plan):
        raise UsageError(
            "--faults: kind 'slow' needs a straggler detector in the training loop, and this "
            "example does not run one: see docs/straggler.md (tests/dist/test_straggler.py "
            "plays slow@rank1 with a detector)"
        )
    if active > world:
        raise UsageError(
            f"--active ({active}) must be <= the number of processes ({world}): lower --active "
            "or start more processes (--nproc-per-node)"
        )
    respawns = int(os.environ.get("INPROCESS_MAX_RESPAWNS", "0"))
    empty = faults.no_rank_left(plan, world_size=world, active=active, max_respawns=respawns)
    if empty is not None:
        raise UsageError(f"--faults: {empty}")
    if args.report_png is not None and importlib.util.find_spec("matplotlib") is None:
        raise UsageError("--report-png needs matplotlib: pip install -e '.[plot]'")
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
    # Only now the 3-4 s of torch's (and DCP's) import: bad input and a finished run answer at
    # once, before it.
    import torch
    from gpt import GPTConfig, batch, build_model, corpus
    from parallel import data_rank, shard
    from state import TrainState

    from restartable.checkpoint import CheckpointManager
    from restartable.inprocess import context, restartable
    from restartable.inprocess.preemption import PREEMPTED_EXIT_CODE, PreemptionHandler
    from restartable.rerun import RerunDataIterator, RerunStateMachine
    from restartable.rerun.scrub import Scrubber

    torch.set_num_threads(1)  # 4 ranks on 2 cores: more threads only contend
    if args.device == "cuda":
        _check_gpus(torch, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if args.fresh:
        rundir.start_fresh(run_dir, initial_rank=initial_rank, launch=launch)
    log_file = story.configure(run_dir / "logs" / launch, rank=initial_rank, debug=args.debug)
    if initial_rank == 0:
        log.info("details of every rank: %s", log_file.parent)
        shrink = faults.shrink_warning(plan, world_size=world, active=active, max_respawns=respawns)
        if shrink is not None:
            log.warning("%s", shrink)
    # One journal directory per launch (a resumed run is a new launch with the same run dir):
    # the report of this launch reads only its own records.
    journal_dir = run_dir / "journal" / launch
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

    # Silent data corruption: a warm reserve re-computes sampled steps while it waits (prewarm).
    def forward(m: torch.nn.Module, xy: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return m(xy[0].to(device_of(m)), xy[1].to(device_of(m)))

    scrub = Scrubber(
        every=args.scrub_every,
        mode=scrub_mode,  # type: ignore[arg-type]
        compute=forward,
        make_model=lambda: build_model(cfg, args.seed),
        make_store=scrubbing.store_factory() if scrub_mode == "reserve" else None,
        checkpoints=mgr,  # a finding quarantines the checkpoints after its verified step
    )
    corruption = scrubbing.Corruption(plan, run_dir)

    @restartable(
        prewarm=scrub.serve,
        # gloo for CPU tensors: NCCL, the default where CUDA is available, reduces only GPU ones.
        backend="nccl" if args.device == "cuda" else "gloo",
        soft_timeout=args.soft_timeout,
        hard_timeout=args.hard_timeout,
        heartbeat_interval=0.5,
        active_world_size=active,
        granularity="rank",
        # The framework's own record of the run: `python -m restartable.inprocess.report
        # RUN_DIR/journal/L`.
        journal_dir=str(journal_dir),
        calculate_timeouts=args.calculate_timeouts,
        safety_factor=args.safety_factor,
        # Without --calculate-timeouts the sections below only time; nothing judges them.
        timeouts_state_path=str(run_dir / "ft_state.json") if args.calculate_timeouts else None,
    )
    def train(preempt: PreemptionHandler) -> dict[str, Any]:
        ctx = context()
        cuda = args.device == "cuda"
        with ctx.section("setup"):  # model, optimizer and restore: until the first step
            # Built afresh in every iteration: whatever a fault left half-done is dropped, and
            # the state comes back from the checkpoint (the manager outlives iterations, the
            # rest not). in_job: a result that needs other hardware to judge hands this rank's
            # work to a warm reserve inside the job (RerunExit with a rank action) instead of
            # exiting with code 16.
            rsm = RerunStateMachine(
                mode="validate_results",
                check_for_nan_in_loss=True,
                check_for_spiky_loss=True,
                in_job=True,
                # On the CPU every rank shares the "cpu" device: the process is the hardware.
                hardware_id=None if args.device == "cuda" else f"cpu-rank{ctx.initial_rank}",
            )
            # The group of this iteration has set this rank's GPU (LOCAL_RANK) for NCCL.
            device = torch.device(args.device, torch.cuda.current_device() if cuda else None)
            model = build_model(cfg, args.seed).to(device)
            corruption.attach(model)  # the sdc faults' gradient hook, before the scrubber's
            # DDP, or sharded on a mesh of this iteration's group (examples/parallel.py).
            net = shard(model, args.parallel, world=ctx.world_size, device=device)
            opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
            state = TrainState(model, opt, rsm, ctx.rank)
            ckpt = {"train": state}

            t0 = time.monotonic()
            restored = mgr.load_latest(ckpt)
            restore = mgr.last_restore
            start = state.step if restored is not None else 0
            scrub.begin(model, rank=ctx.rank, world=ctx.world_size, initial_rank=ctx.initial_rank)
            start = scrub.restore(start, restore=scrubbing.restore_into(state))
        if ctx.rank == 0:
            _tell_restart(ctx.last_restart, run_dir, restored, restore, time.monotonic() - t0)
        tick, tick_step = time.monotonic(), start
        for step in range(start, args.steps):
            ctx.ping(step)  # the step lets the wrapper spot the same fault repeating at a step
            with ctx.section("step"):  # a hang in here is caught at the learned timeout
                # Fires this rank's planned faults once per run, each recorded in the run dir first
                # (the report times them); a due NaN comes back for the loss of the first attempt.
                due = faults.fire_planned(plan, step=step, record_dir=run_dir)
                nan_due = due if due is not None and due.kind == "nan" else None
                corruption.fired(due, step)
                xy = batch(
                    data,
                    seed=args.seed,
                    step=step,
                    rank=data_rank(args.parallel, ctx.rank),
                    batch_size=args.batch_size,
                    seq=cfg.seq,
                )
                batches = RerunDataIterator(iter([xy]))
                # Sampled steps: copy the state and start agreeing on the reserve's answers
                # (after_step reads the verdict, and may roll back).
                # Not step 0: torch's get_state_dict creates an unstepped AdamW's state (step
                # 1), which would change every later update.
                if step > 0 and scrubbing.scrubbed(args, step):
                    scrub.before_step(step, xy, snapshot=state.state_dict)
                attempts = 0
                while rsm.should_run_forward_backward(batches):
                    attempts += 1
                    opt.zero_grad(set_to_none=True)
                    x, y = next(batches)
                    loss = net(x.to(device), y.to(device))
                    if nan_due is not None and attempts == 1:
                        loss = loss * float("nan")  # a transient numerical fault on this rank
                    loss.backward()
                    rsm.validate_loss(loss)
                scrub.after_step(loss)  # the verdict; a check sent to the reserve, or made in place
                _, exit_now, _ = rsm.should_checkpoint_and_exit()
                if exit_now:  # a verdict that needs other hardware or a person: see rerun/README
                    rsm.exit_or_raise(close=[mgr])  # the checkpoint is committed first
                opt.step()
            state.step, state.loss = step + 1, loss.detach()
            stop = preempt.should_stop()
            with ctx.section("checkpointing"):
                mgr.save(state.step, ckpt, force_persistent=stop)
            if ctx.rank == 0 and (step + 1) % args.log_every == 0:
                rate = (step + 1 - tick_step) / (time.monotonic() - tick)
                tick, tick_step = time.monotonic(), step + 1
                print(
                    f"step {step + 1:5d}  loss {float(state.loss):.4f}  {rate:6.1f} steps/s",
                    flush=True,
                )
            if stop:
                mgr.wait()
                return {
                    "step": state.step,
                    "loss": float(state.loss),
                    "preempted": True,
                    "rank": ctx.rank,
                }
        mgr.wait()
        return {"step": state.step, "loss": float(state.loss), "preempted": False, "rank": ctx.rank}

    try:
        with PreemptionHandler(exit_signal=signal.SIGTERM) as preempt:
            result = train(preempt)
    finally:
        # Also when train() stops for good (RestartAbortedError): a save still in flight is
        # abandoned here, instead of holding the interpreter's exit until its timeout.
        mgr.close()
        scrub.close()
    if result is None:  # a reserve that was never needed
        checks, seconds = scrub.reserve_stats
        if checks:
            log.info("sdc scrubbing: this reserve checked %d step(s) in %.3f s", checks, seconds)
        return 0
    if result["rank"] == 0:
        if not result["preempted"]:
            rundir.mark_finished(run_dir, steps=result["step"], loss=result["loss"])
        # train() has returned: this rank's journal is closed (its job_end written). The report
        # of the launch just run is the framework's, from every rank's journal; its wall time
        # ends at the last job_end written so far (the other ranks end at the same step).
        _write_report(journal_dir, run_dir, result, png=args.report_png)
    return PREEMPTED_EXIT_CODE if result["preempted"] else 0


def device_of(m: Any) -> Any:
    return next(m.parameters()).device


def _check_gpus(torch: Any, local_world_size: int) -> None:
    """--device cuda: NCCL needs a GPU of its own for every rank of a node."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0:
        raise UsageError("--device cuda: no CUDA device is available here: use --device cpu")
    if local_world_size > gpus:
        raise UsageError(
            f"--device cuda: {local_world_size} processes on this node (LOCAL_WORLD_SIZE) but "
            f"{gpus} GPU(s); NCCL runs one rank per GPU: start at most {gpus} per node "
            f"(--nproc-per-node {gpus}) or use --device cpu"
        )


def _write_report(
    journal_dir: Path, run_dir: Path, result: dict[str, Any], *, png: Path | None
) -> None:
    """Print this launch's downtime report and write it to RUN_DIR/report.json (rank 0)."""
    rep = reports(journal_dir)[-1]  # the journal directory is this launch's alone
    print(format_report(rep), flush=True)
    attempts = reports(run_dir / "journal")  # this run's launches: a requeue resumes the run
    if result["preempted"]:  # report.json is the finished run's: the next attempt writes it
        k, loss = len(attempts) - 1, result["loss"]
        print(f"preempted at step {result['step']} (attempt {k}), loss {loss:.4f}", flush=True)
        return
    print(f"final step {result['step']} (steps completed), final loss {result['loss']:.4f}")
    out = {**rep.as_dict(), "final_step": result["step"], "final_loss": result["loss"]}
    if len(attempts) > 1:  # the job over its attempts: requeue gaps and redo added up
        view = job_view.build(attempts)
        print(job_view.format_view(view), flush=True)
        out["job"] = view.as_dict()
    (run_dir / "report.json").write_text(json.dumps(out, indent=2))
    print(f"report written to {run_dir / 'report.json'}", flush=True)
    if png is not None:
        plot([rep], read_journal(journal_dir), png)
        print(f"timeline written to {png}", flush=True)


def _tell_restart(
    record: RestartRecord | None, run_dir: Path, step: int | None, restore: Any, reload_s: float
) -> None:
    """The console's line for the restart (or the resume) that led into this train() call."""
    tier = getattr(restore, "tier", None) or "no"
    if record is not None:
        down = sum(record.phases.values()) + reload_s
        # The cause names initial ranks (RANK at launch); the fault plan and the report name a
        # rank as ctx.rank did in the faulted iteration: say both, as the report does.
        before = list(record.active_before)

        def both(m: re.Match[str]) -> str:
            r = int(m[1])
            return f"on rank {before.index(r)} (initial {r})" if r in before else m[0]

        log.info(
            # rank 0's tier: the report's "restored from" names every rank's
            "restart %d: %s; back at step %d, rank 0 from the %s tier, %.2f s after the fault",
            record.iteration,
            re.sub(r"on rank (\d+)", both, record.cause),
            step or 0,
            tier,
            down,
        )
    elif step is not None:
        log.info("resuming %s at step %d (%s tier); --fresh starts over", run_dir, step, tier)


if __name__ == "__main__":
    sys.exit(main())
