"""Train a tiny byte-level GPT with DDP through injected faults, then report the downtime.

Run (4 ranks on this machine's CPU, each fault kind once, about a minute):

    python -m inprocess.launch --nproc-per-node 4 examples/train.py --faults demo

It uses all three packages: ``@restartable`` re-runs ``train()`` in place after a fault (warm
reserves replace lost ranks), ``CheckpointManager`` keeps a host-memory copy every step and a
torch_dist checkpoint every ``--persistent-every`` steps, and ``RerunStateMachine`` re-runs a step
whose loss is NaN or spiky. At the end one rank prints the downtime report and writes it to
``RUN_DIR/report.json`` (and a PNG timeline with ``--report-png``).

SIGTERM (forwarded by the launcher, or sent by Slurm before the time limit) makes every rank
finish its step, write a persistent checkpoint and exit with status 75; the next launch with the
same ``--run-dir`` resumes from that step.
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
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpt import GPTConfig, batch, build_model, corpus
from report import EventLog, build_report, format_report, write_png

from checkpoint import CheckpointManager
from inprocess import context, faults, restartable
from inprocess.preemption import PREEMPTED_EXIT_CODE, PreemptionHandler
from rerun import RerunDataIterator, RerunStateMachine

log = logging.getLogger("train")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    p.add_argument("--faults", default="demo", help=faults.plan_help() + "\n(default: demo)")
    p.add_argument("--active", type=int, default=None, help="ranks running train(); rest reserve")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--run-dir", type=Path, default=Path("runs/example"))
    p.add_argument("--persistent-every", type=int, default=50)
    p.add_argument(
        "--local-dir",
        default=None,
        help="node-local checkpoint dir (default: RUN_DIR/local/<launch>; 'none': memory only)",
    )
    p.add_argument("--soft-timeout", type=float, default=2.0)
    p.add_argument("--hard-timeout", type=float, default=5.0)
    p.add_argument("--report-png", type=Path, default=None)
    p.add_argument("--log-every", type=int, default=25)
    return p.parse_args(argv)


class TrainState(Stateful):
    """Everything a restart restores: model, optimizer, re-run machine, step."""

    def __init__(
        self, model: torch.nn.Module, opt: torch.optim.Optimizer, rsm: RerunStateMachine, rank: int
    ):
        self.model, self.opt, self.rsm = model, opt, rsm
        # The re-run machine's state differs per rank: a rank-specific key keeps torch_dist's
        # de-duplication of identical keys from saving rank 0's copy for everyone.
        self.rerun_key = f"rerun_rank{rank}"
        self.step = 0
        self._cached: tuple[tuple[Any, ...], dict[str, Any], dict[str, Any]] | None = None

    def _model_and_optim(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """torch's ``get_state_dict``, reused while it still describes the live tensors.

        It costs about 3 ms here (FQN mapping), most of a local save made at every step. Its
        dicts reference the live parameters and optimizer states, which training updates in
        place, so they stay valid until a tensor is replaced (optimizer state created or
        loaded, a parameter re-assigned): the identity check below notices that and rebuilds.
        Hyperparameters (plain floats, e.g. a scheduled lr) are copied fresh every time.
        """
        live = (
            *((id(t), t.data_ptr()) for t in self.model.parameters()),
            *((id(t), t.data_ptr()) for t in self.model.buffers()),
            *(
                (id(v), v.data_ptr())
                for st in self.opt.state.values()
                for v in st.values()
                if isinstance(v, torch.Tensor)
            ),
        )
        if self._cached is None or self._cached[0] != live:
            self._cached = (live, *get_state_dict(self.model, self.opt))
        _, model_sd, optim_sd = self._cached
        for cached, group in zip(optim_sd["param_groups"], self.opt.param_groups, strict=True):
            cached.update((k, v) for k, v in group.items() if k != "params")
        return model_sd, optim_sd

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = self._model_and_optim()
        return {
            "model": model_sd,
            "optim": optim_sd,
            self.rerun_key: self.rsm.state_dict(),
            "step": self.step,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self._cached = None
        set_state_dict(
            self.model, self.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"]
        )
        self.rsm.load_state_dict(sd[self.rerun_key])
        self.step = int(sd["step"])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)  # 4 ranks on 2 cores: more threads only contend
    world = int(os.environ.get("WORLD_SIZE", "1"))
    initial_rank = int(os.environ.get("RANK", "0"))
    # One warm reserve per fault that loses its rank; then the plan is checked against the
    # ranks that train (a fault on a rank that never trains would silently never fire).
    try:
        losing = sum(f.loses_rank for f in faults.parse_plan(args.faults, steps=args.steps))
        active = args.active or max(1, world - losing)
        plan = faults.parse_plan(args.faults, steps=args.steps, world_size=active)
    except ValueError as e:
        raise SystemExit(f"train.py: error: --faults: {e}") from None
    run_dir = args.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    # One event directory per launch (a resumed run is a new launch with the same run dir).
    launch_id = os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID")
    launch_id = launch_id or f"{os.environ.get('MASTER_ADDR')}-{os.environ.get('MASTER_PORT')}"
    events_dir = run_dir / "events" / launch_id
    events = EventLog(events_dir, initial_rank)
    events.emit("start")
    data = corpus()
    cfg = GPTConfig()

    # The node-local copy lets a reserve that replaces a killed rank on the same machine restore
    # that rank's shard without a peer on another node; one directory per launch, so a later
    # launch never restores a stale local step.
    local_dir = None if args.local_dir == "none" else args.local_dir
    if args.local_dir is None:
        local_dir = str(run_dir / "local" / launch_id)
        Path(local_dir).mkdir(parents=True, exist_ok=True)
    mgr = CheckpointManager(
        str(run_dir / "ckpt"),
        persistent_every=args.persistent_every,
        keep=2,
        local_every=1,
        local_dir=local_dir,
        replication_factor=2 if active > 1 else 1,
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
        loss = torch.tensor(float("nan"))
        tick = time.monotonic()
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
                rate = args.log_every / (time.monotonic() - tick)
                tick = time.monotonic()
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

    with PreemptionHandler(exit_signal=signal.SIGTERM) as preempt:
        result = train(preempt)
    mgr.close()
    if result is None:  # a reserve that was never needed
        events.close()
        return 0
    events.emit("done", rank=result["rank"], step=result["step"], loss=result["loss"])
    if result["rank"] == 0:
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


def _restart_phases(ctx: Any) -> dict[str, float]:
    """The wrapper's per-phase timings of the restart that led here (seconds)."""
    record = ctx.last_restart
    return {} if record is None else {f"{k}_s": v for k, v in record.phases.items()}


if __name__ == "__main__":
    sys.exit(main())
