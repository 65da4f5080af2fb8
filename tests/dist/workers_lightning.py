"""Rank code for the Lightning tests: a real ``Trainer(accelerator="cpu", devices=2,
strategy="ddp")`` fitting a small regression model.

    python -m restartable.launch --nproc-per-node 2 --max-restarts 2 \
        tests/dist/workers_lightning.py '<json options>'          # fit() under ft.restartable
    run_ranks(target="tests.dist.workers_lightning:straggler")   # plain DDP, one slowed rank
    run_ranks(target="tests.dist.workers_lightning:renumbered")  # @restartable with a reserve

Every epoch is one batch per rank (16 samples, 8 per rank), so each checkpoint is at an epoch
boundary: resuming a plain ``DataLoader`` mid-epoch makes Lightning replay the epoch's first
batches, a Lightning limit that would hide whether our tiers restored the right state.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

PERSISTENT_EVERY = 4  # steps between persistent (torch_dist) saves; local saves every step
FAST = {
    # Trainer(accelerator="cpu"): gloo, also on a host with a GPU (the default is nccl there).
    "backend": "gloo",
    "soft_timeout": 20.0,
    "hard_timeout": 30.0,
    "heartbeat_interval": 0.1,
    "barrier_timeout": 30.0,
    "completion_timeout": 30.0,
    "termination_grace_time": 0.5,
}


class Regression(L.LightningModule):
    """An MLP with Adam (optimizer state that must come back with the checkpoint)."""

    def __init__(self, kills: list[dict[str, Any]] | None = None, burn: float = 1.0) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
        )
        self.kills = kills or []
        self.burn = burn  # compute multiplier of this rank (straggler test)
        self.losses: list[tuple[int, float]] = []

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        c0 = time.process_time()
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        if self.burn > 1.0:  # burn extra CPU like a slower device would (not a sleep)
            for _ in range(int(self.burn - 1) * 40):
                torch.nn.functional.mse_loss(self.net(x), y)
            while time.process_time() - c0 < 0.004 * (self.burn - 1):
                pass
        for k in self.kills:
            if self.global_rank != k["rank"] or self.global_step != k["step"]:
                continue
            marker = Path(k["marker"])
            if not marker.exists():  # once per job: the restarted processes must not die again
                marker.write_text(str(os.getpid()))
                if k.get("wipe"):  # the node-local copies are lost with the process
                    mgr, due = k["manager"], self.global_step // PERSISTENT_EVERY * PERSISTENT_EVERY
                    deadline = time.monotonic() + 30.0
                    while (mgr.latest_step() or -1) < due and time.monotonic() < deadline:
                        time.sleep(0.02)  # the background writer commits step `due`
                    shutil.rmtree(Path(mgr.root).parent / "local", ignore_errors=True)
                os.kill(os.getpid(), signal.SIGKILL)
        self.losses.append((self.global_step, float(loss.detach())))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.05)


def data() -> DataLoader:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(16, 8, generator=g)
    y = (x[:, :1] * 2.0 - x[:, 1:2]).tanh() + 0.1 * torch.randn(16, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=False)


def trainer_kwargs(epochs: int, callbacks: list[Any], root: Path) -> dict[str, Any]:
    return {
        "accelerator": "cpu",
        "devices": 2,
        "strategy": "ddp",
        "max_epochs": epochs,
        "callbacks": callbacks,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "default_root_dir": str(root),
    }


def fit_main(opts: dict[str, Any]) -> None:
    """``opts``: dir, epochs, local_dir (bool), config, clean_port, kills
    ([{rank, step, wipe}]: SIGKILL that rank at that step, once per job; with ``wipe`` it first
    waits until the newest persistent save is committed, then deletes the node-local
    checkpoint directory, so that the restart must come back from the persistent tier)."""
    from restartable.checkpoint import CheckpointManager
    from restartable.checkpoint.lightning import TieredCheckpoint
    from restartable.inprocess.lightning import FaultToleranceCallback

    d = Path(opts["dir"])
    rank = int(os.environ["RANK"])
    (d / "local").mkdir(parents=True, exist_ok=True)
    mgr = CheckpointManager(
        str(d / "ckpt"),
        persistent_every=PERSISTENT_EVERY,
        keep=2,
        local_every=1,
        local_dir=str(d / "local") if opts.get("local_dir", True) else None,
    )
    ft = FaultToleranceCallback(autoresume=True, calculate_timeouts=True, exp_dir=d / "ft")
    kills = [
        {**k, "marker": str(d / f"killed.{i}"), "manager": mgr}
        for i, k in enumerate(opts.get("kills", []))
    ]

    @ft.restartable(**{**FAST, **opts.get("config", {})})
    def train() -> dict[str, Any]:
        L.seed_everything(0, verbose=False)
        model = Regression(kills=kills)
        # At each epoch's end (one step each): Lightning 2.6.6 miscounts the epoch when it
        # resumes twice from every_n_train_steps checkpoints taken at an epoch's last batch
        # (plain .ckpt files too), which the two-kill test would take for our tiers' fault.
        last = ModelCheckpoint(
            dirpath=str(d / "ptl"), every_n_epochs=1, save_on_train_epoch_end=True, save_last=True
        )
        trainer = L.Trainer(**trainer_kwargs(opts["epochs"], [ft, TieredCheckpoint(mgr), last], d))
        trainer.fit(model, train_dataloaders=data(), ckpt_path="last")
        restore = mgr.last_restore
        return {
            "rank": trainer.global_rank,
            "pid": os.getpid(),
            "global_step": trainer.global_step,
            "losses": model.losses,
            "final_loss": model.losses[-1][1],
            "restore": None if restore is None else [restore.step, restore.tier],
            "params": [float(p.detach().sum()) for p in model.parameters()],
        }

    result = train()
    mgr.close()
    if "clean_port" in opts:  # the reference: the same fit without a fault, same processes
        result["clean"] = clean_fit(opts["epochs"], opts["clean_port"], d / "clean")
    (d / f"result.{rank}.json").write_text(json.dumps(result))


def clean_fit(epochs: int, port: int, root: Path) -> dict[str, Any]:
    """A plain Lightning DDP fit (Lightning creates its own group on ``port``), no checkpoints."""
    os.environ["MASTER_PORT"] = str(port)  # the launcher's store holds MASTER_PORT
    # As under torchrun, the launcher says its agent store serves MASTER_PORT, so every rank of a
    # script's own group would connect as a client; on a port of its own, rank 0 must host it.
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"
    L.seed_everything(0, verbose=False)
    model = Regression()
    kwargs = {**trainer_kwargs(epochs, [], root), "enable_checkpointing": False}
    trainer = L.Trainer(**kwargs)
    trainer.fit(model, train_dataloaders=data())
    return {
        "global_step": trainer.global_step,
        "losses": model.losses,
        "final_loss": model.losses[-1][1],
        "params": [float(p.detach().sum()) for p in model.parameters()],
    }


def straggler(slow_rank: int, steps: int, interval: float) -> dict[str, Any]:
    """Plain Lightning DDP (Lightning creates the group); ``slow_rank`` computes ~3x longer."""
    from restartable.straggler.lightning import StragglerDetectionCallback

    d = Path(os.environ["TEST_RESULT_DIR"])
    rank = int(os.environ["RANK"])
    cb = StragglerDetectionCallback(
        report_time_interval=interval, stop_if_detected=True, num_gpu_perf_scores_to_log=2
    )
    last = ModelCheckpoint(dirpath=str(d / "ptl"), save_last=True, save_top_k=0)
    model = Regression(burn=3.0 if rank == slow_rank else 1.0)
    kwargs = trainer_kwargs(10_000, [cb, last], d)
    trainer = L.Trainer(**{**kwargs, "max_steps": steps})
    trainer.fit(model, train_dataloaders=data())
    return {
        "global_step": trainer.global_step,
        "stragglers": [sorted(r.stragglers) for r in cb.reports],
        "stop": [r.stop for r in cb.reports],
        "relative": [r.relative for r in cb.reports],
        "stopped_fit": cb.stopped_fit,
        "last_ckpt": (d / "ptl" / "last.ckpt").is_file(),
    }


def renumbered() -> dict[str, Any] | None:
    """3 processes, 2 active under @restartable: the reserve (RANK 2) takes the place of rank 1,
    SIGKILLed in iteration 0. What Lightning makes of the reserve's rank is the evidence that an
    in-process restart of fit() is unsafe once ranks are renumbered; the FT callback's guard
    must refuse it."""
    from restartable.inprocess import context, restartable
    from restartable.inprocess.lightning import (
        _UNDER,
        FaultToleranceCallback,
        LightningRestartError,
    )

    @restartable(active_world_size=2, min_active_world_size=2, **FAST)
    def train() -> dict[str, Any]:
        ctx = context()
        if ctx.iteration == 0:
            if ctx.initial_rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)  # rank 0: the restart interrupts this
        model = Regression()
        trainer = L.Trainer(**trainer_kwargs(1, [], Path(os.environ["TEST_RESULT_DIR"])))
        try:
            trainer.strategy.setup_environment()  # what fit() does first
            setup_error = None
        except Exception as exc:
            setup_error = f"{type(exc).__name__}: {exc}"
        ft = FaultToleranceCallback()
        token = _UNDER.set(ft)  # as inside ft.restartable(), which refuses reserves up front
        try:
            ft.setup(trainer, model, "fit")
            ft.teardown(trainer, model, "fit")
            guard = None
        except LightningRestartError as exc:
            guard = str(exc)
        finally:
            _UNDER.reset(token)
        return {
            "iteration": ctx.iteration,
            "initial_rank": ctx.initial_rank,
            "group_rank": torch.distributed.get_rank(),
            "group_world": torch.distributed.get_world_size(),
            "lightning_rank": trainer.global_rank,
            "lightning_world": trainer.world_size,
            "guard": guard,
            "setup_error": setup_error,
        }

    return train()


if __name__ == "__main__":
    fit_main(json.loads(sys.argv[1]))
