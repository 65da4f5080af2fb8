"""The training job every fault-matrix row runs (``python -m restartable.launch ... job.py``).

A small model (DDP, or FSDP2 with ``"parallel": "fsdp"``), 2 active ranks and 1 warm reserve, a
checkpoint every step in the local tier (host memory + node-local directory) and every 4 steps
in the persistent tier; the batch of each step is a function of the step and rank only, so a job
that survives its faults ends with exactly the parameters of a clean run. The row to play
arrives as JSON in ``FAULT_ROW``::

    {"kind": "kill", "phase": "step", "rank": 1, "iteration": 0, "step": 5, "precursor": false}

``kind`` is an ``inprocess.faults`` kind (plus ``corrupt_local``, ``corrupt_persistent``,
``full_disk`` and ``forged_value``, played by the job itself); ``rank`` is the training rank
(``ctx.rank``), or "reserve" (the fault fires in the waiting reserve); ``precursor`` adds an
exception on rank 1 at step 2 of iteration 0, so that the row's fault fires in iteration 1
(after a restart).

Each process writes ``RUN_DIR/end/<initial rank>.json`` as its last act: the result, the
threads still alive and the open file descriptors against a baseline taken after the first
iteration's set-up. Phases and what "during" means are listed in tests/faults/matrix.py.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from restartable.checkpoint import CheckpointManager
from restartable.inprocess import context, restartable
from restartable.inprocess.faults import PlannedFault, trigger
from restartable.inprocess.faults.sdc import GradientBitFlip, corrupting
from restartable.inprocess.preemption import PREEMPTED_EXIT_CODE, PreemptionHandler
from restartable.inprocess.store_server import client
from restartable.rerun.scrub import Scrubber

STEPS = 12
SCRUB_STEP_S = 0.2  # sdc rows: a step lasts longer than the reserve's check of one
PERSISTENT_EVERY = 4


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True)


class Job:
    """One process of the job: the row, the run directory and what it observed."""

    def __init__(self, run_dir: Path, row: dict[str, Any]) -> None:
        self.run_dir = run_dir
        self.row = row
        self.initial_rank = int(os.environ["RANK"])
        self.baseline_fds: int | None = None

    def due(self, phase: str, who: int | str, iteration: int, step: int | None) -> bool:
        """Whether the row's fault is due here: ``who`` is ``ctx.rank`` (or "reserve")."""
        r = self.row
        ranks = {r.get("rank"), (r.get("also") or {}).get("rank")}
        if r.get("phase") != phase or who not in ranks:
            return False
        if r.get("iteration", 0) != iteration:
            return False
        return r.get("step") is None or step is None or r["step"] == step

    def fire(self, kind: str, *, rank: int, iteration: int, step: int | None) -> bool:
        """Fire ``kind`` once per run (recorded under RUN_DIR/faults); True if it fired here."""
        if kind in ("corrupt_local", "corrupt_persistent", "full_disk", "forged_value"):
            return self._storage_fault(kind, rank=rank, iteration=iteration, step=step)
        return trigger(
            PlannedFault(kind, rank, step),
            record_dir=self.run_dir / "faults",
            initial_rank=self.initial_rank,
            iteration=iteration,
            step=step,
        )

    def maybe(self, phase: str, *, who: int | str, iteration: int, step: int | None) -> bool:
        """Fire the row's fault if due at this point; True only for a due ``nan``."""
        if self.row.get("precursor") and (phase, who, iteration, step) == ("step", 1, 0, 2):
            self.fire("exception", rank=1, iteration=0, step=2)
        if not self.due(phase, who, iteration, step):
            return False
        rank = who if isinstance(who, int) else -1
        also = self.row.get("also")
        if also is not None and rank == also["rank"] != self.row["rank"]:
            # The second fault of a pair: the same point, another rank.
            return self.fire(also["kind"], rank=rank, iteration=iteration, step=step)
        return self.fire(self.row["kind"], rank=rank, iteration=iteration, step=step)

    def _storage_fault(self, kind: str, *, rank: int, iteration: int, step: int | None) -> bool:
        from restartable.inprocess.faults.record import FiredFault, record_once

        record = FiredFault(kind, kind, rank, self.initial_rank, iteration, step, time.time(), 0)
        if not record_once(self.run_dir / "faults", record):
            return False
        if kind == "corrupt_local":  # every local file of this rank, then lose the rank
            for f in (self.run_dir / "local").rglob("*"):
                if f.is_file():
                    _flip(f)
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "corrupt_persistent":  # the newest committed checkpoint's data, then raise
            newest = _newest_committed(self.run_dir / "ckpt", at_least=(step or 0) // 4 * 4)
            for f in Path(newest).glob("*.distcp"):
                _flip(f)
            raise RuntimeError(f"injected: corrupted {newest}")
        if kind == "forged_value":  # a stranger's unsealed "done" for this iteration's outcome
            import datetime

            from torch.distributed import TCPStore

            from restartable.inprocess.protocol import keys

            stranger = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                timeout=datetime.timedelta(seconds=10))  # fmt: skip
            stranger.set(keys.end_key(iteration), keys.OUTCOME_DONE)
        if kind == "full_disk":  # fill the persistent tier's filesystem (a tmpfs the test made)
            with open(self.run_dir / "ckpt" / "filler", "wb") as f:
                try:
                    while True:
                        f.write(b"\0" * (1 << 20))
                except OSError:
                    pass
        return True


def _newest_committed(root: Path, *, at_least: int, timeout: float = 20.0) -> str:
    """The newest committed checkpoint's directory, once its step is >= ``at_least``."""
    from restartable.checkpoint.persistent import CheckpointDirs

    end = time.monotonic() + timeout
    while True:
        committed = CheckpointDirs(str(root)).list_committed()
        if committed and committed[-1].step >= at_least:
            return str(committed[-1].path)
        if time.monotonic() > end:
            raise TimeoutError(f"no checkpoint of step >= {at_least} committed in {timeout} s")
        time.sleep(0.05)


def _flip(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(max(0, os.path.getsize(path) // 2))
        b = f.read(1)
        f.seek(-len(b), os.SEEK_CUR)
        f.write(bytes([(b[0] if b else 0) ^ 0xFF]))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _forward(m: torch.nn.Module, xy: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return torch.nn.functional.mse_loss(m(xy[0]), xy[1])


def _scrubber(mode: str, mgr: CheckpointManager) -> Scrubber:
    """sdc rows: a warm reserve re-computes every step of one rank (rotating), or each rank
    its own (in place); a finding quarantines ``mgr``'s checkpoints after its verified step."""
    host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"])
    return Scrubber(
        every=1,
        mode=mode,  # type: ignore[arg-type]
        compute=_forward,
        make_model=_model,
        make_store=lambda: client(host, port, timeout=30.0),
        checkpoints=mgr,
    )


def _snapshot(state: dict[str, Any]) -> dict[str, Any]:
    return {"model": state["model"].state_dict(), "optim": state["optim"].state_dict()}


def _load(state: dict[str, Any], sd: dict[str, Any]) -> None:
    state["model"].load_state_dict(sd["model"])
    state["optim"].load_state_dict(sd["optim"])


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True, type=Path)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    run_dir: Path = args.run_dir
    job = Job(run_dir, json.loads(os.environ.get("FAULT_ROW", "{}")))
    point = job.row.get("crash_at")
    if point is not None and job.row.get("rank") == job.initial_rank:
        # Only in the process that starts as that rank: the reserve that replaces it must not
        # crash at the same point again (the hook has no memory of its own).
        os.environ["RESTARTABLE_CKPT_CRASH_AT"] = point
    for sub in ("end", "local"):
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
    mgr = CheckpointManager(
        str(run_dir / "ckpt"),
        persistent_every=PERSISTENT_EVERY,
        keep=2,
        **(
            {"local_every": 1, "local_dir": str(run_dir / "local")}
            if job.row.get("local", True)
            else {}
        ),
        timeout=30.0,
    )

    scrub = _scrubber(job.row.get("scrub", "off"), mgr)

    def reserve_waits() -> None:
        scrub.serve()  # sdc rows: the reserve re-computes the checked steps
        job.maybe("reserve", who="reserve", iteration=0, step=None)

    @restartable(
        backend="gloo",  # CPU tensors, also on a host with a GPU (the default is nccl there)
        soft_timeout=2.0,
        hard_timeout=4.0,
        active_world_size=2,
        barrier_timeout=30.0,
        completion_timeout=20.0,
        max_iterations=8,
        prewarm=reserve_waits if job.row.get("rank") == "reserve" or scrub.mode != "off" else None,
    )
    def train(preempt: PreemptionHandler) -> dict[str, Any]:
        ctx = context()
        it = ctx.iteration
        job.maybe("startup", who=ctx.rank, iteration=it, step=None)
        model = _model()
        flip = GradientBitFlip()
        flip.attach(model)  # sdc rows: before the scrubber's gradient capture
        if corrupting(run_dir / "faults"):
            flip.arm_lasting()
        if job.row.get("parallel") == "fsdp":  # sharded: DTensor parameters and moments
            mesh = init_device_mesh("cpu", (ctx.world_size,))
            for module in (model[0], model[2], model):
                fully_shard(module, mesh=mesh)
            ddp: torch.nn.Module = model
        else:
            ddp = DDP(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        state = {"model": model, "optim": opt}
        job.maybe("restore", who=ctx.rank, iteration=it, step=None)
        start = mgr.load_latest(state) or 0
        scrub.begin(model, rank=ctx.rank, world=ctx.world_size, initial_rank=ctx.initial_rank)
        if it == 0:  # the first steps are checked too (after a retirement no reserve is left)
            scrub.wait_for_reserve(60.0)
        start = scrub.restore(start, restore=lambda sd: _load(state, sd))
        if job.baseline_fds is None:
            job.baseline_fds = _fds()
        for step in range(start, STEPS):
            ctx.ping(step)
            if job.row.get("kind") == "store_loss" and job.due("step", ctx.rank, it, step):
                print(f"job: step {step}", flush=True)  # the test kills the launcher now
                time.sleep(30)
            nan = job.maybe("step", who=ctx.rank, iteration=it, step=step)
            if nan and job.row["kind"].startswith("sdc"):
                flip.arm_once() if job.row["kind"] == "sdc-once" else flip.arm_lasting()
                nan = False
            x, y = _batch(step, ctx.rank)
            if scrub.mode != "off":
                time.sleep(SCRUB_STEP_S)
                scrub.before_step(step, (x, y), snapshot=lambda: _snapshot(state))
            loss = _forward(ddp, (x, y))
            if nan:
                loss = loss * float("nan")
            if not torch.isfinite(loss):
                raise FloatingPointError(f"loss is {loss.item()} at step {step}")
            # The peers are inside backward's all_reduce while this rank fires.
            job.maybe("collective", who=ctx.rank, iteration=it, step=step)
            loss.backward()
            scrub.after_step(loss)
            with ctx.atomic():
                job.maybe("atomic", who=ctx.rank, iteration=it, step=step)
                opt.step()
                opt.zero_grad(set_to_none=True)
            stop = preempt.should_stop()
            mgr.save(step + 1, state, force_persistent=stop)
            job.maybe("local_save", who=ctx.rank, iteration=it, step=step)
            if stop:
                mgr.wait()
                return {"preempted": True, "step": step + 1, "iteration": it}
        if job.due("completion", ctx.rank, it, None):
            time.sleep(0.3)  # the others are in the completion barrier by now
            job.maybe("completion", who=ctx.rank, iteration=it, step=None)
        mgr.wait()
        full = [q.full_tensor() if isinstance(q, DTensor) else q for q in model.parameters()]
        params = torch.cat([q.detach().flatten() for q in full])
        return {"preempted": False, "step": STEPS, "params": params.tolist(), "iteration": it}

    result: dict[str, Any] | None = None
    status = 0
    try:
        with PreemptionHandler(exit_signal=signal.SIGTERM) as preempt:
            result = train(preempt)
    except BaseException as e:
        status = 1
        result = {"error": f"{type(e).__name__}: {e}"}
        print(f"job: train() stopped: {type(e).__name__}: {e}", flush=True)
    finally:
        mgr.close()
        scrub.close()
    if result is not None and result.get("preempted"):
        status = PREEMPTED_EXIT_CODE
    if dist.is_initialized():
        dist.destroy_process_group()
    job.maybe("exit", who=job.initial_rank, iteration=0, step=None)
    end = {
        "result": result,
        "threads": sorted(
            t.name for t in threading.enumerate() if t is not threading.main_thread()
        ),
        "non_daemon": sorted(
            t.name
            for t in threading.enumerate()
            if not t.daemon and t is not threading.main_thread()
        ),
        "fds": _fds(),
        "baseline_fds": job.baseline_fds,
        "exited_at": time.time(),
    }
    (run_dir / "end" / f"{job.initial_rank}.json").write_text(json.dumps(end))
    return status


if __name__ == "__main__":
    sys.exit(main())
