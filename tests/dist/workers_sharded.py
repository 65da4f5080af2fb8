"""Rank functions for the sharded-model tests: FSDP2, TP and HSDP under @restartable with both
checkpoint tiers (tests/dist/test_sharded.py, benchmarks/restart_latency.py)."""

from __future__ import annotations

import hashlib
import logging
import os
import signal
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

FAST = {
    # CPU tensors: gloo, also on a host with a GPU (where the default backend is nccl).
    "backend": "gloo",
    "soft_timeout": 2.0,
    "hard_timeout": 6.0,
    "heartbeat_interval": 0.5,
    "barrier_timeout": 30.0,
    "completion_timeout": 30.0,
}
DIM = 16  # width of the toy MLP: divisible by every mesh size used here


class _Warnings(logging.Handler):
    """Collects WARNING records of the framework's loggers (the "still referenced" one)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _mlp() -> nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank and every restart
    return nn.Sequential(
        nn.Linear(DIM, 2 * DIM), nn.ReLU(), nn.Linear(2 * DIM, DIM), nn.ReLU(), nn.Linear(DIM, 4)
    )


def build(parallel: str, world: int, *, other_dims: bool = False) -> tuple[nn.Module, Any]:
    """The toy model, sharded by `parallel` on a fresh mesh of the current default group
    (`other_dims`: the same mesh with other dim names, which the local tier refuses)."""
    model = _mlp()
    if parallel == "fsdp":
        dims = ("fsdp",) if other_dims else ("dp",)
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=dims)
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif parallel == "tp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
        parallelize_module(model, mesh, plan)  # type: ignore[arg-type]
    elif parallel == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        raise ValueError(f"parallel ({parallel!r}) must be fsdp, tp or hsdp")
    return model, mesh


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    # The same data on every rank: TP needs it, and FSDP then trains like one process would.
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, DIM, generator=g), torch.randn(8, 4, generator=g)


def _digest(model: nn.Module, opt: torch.optim.Optimizer) -> str:
    """A hash of the full (unsharded) parameters and optimizer moments: equal on every rank,
    whatever the sharding. COLLECTIVE (full_tensor all-gathers)."""
    from torch.distributed.tensor import DTensor

    def full(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if isinstance(t, DTensor) else t

    h = hashlib.sha256()
    tensors = [(n, p) for n, p in sorted(model.state_dict().items())]
    for i, st in sorted(opt.state_dict()["state"].items()):
        tensors += [(f"opt{i}.{k}", v) for k, v in sorted(st.items())]
    for name, t in tensors:
        h.update(name.encode())
        h.update(full(t).detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


class DCPState:
    """A DCP Stateful through torch.distributed.checkpoint.state_dict, as DCP recipes write it."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model, self.opt = model, opt

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.opt)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(
            self.model, self.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"]
        )


def reference_digest(steps: int) -> str:
    """The digest a fault-free run reaches, computed in one process without sharding: every rank
    trains on the same batch, so FSDP's averaged gradients are the single-process ones, bit for
    bit (not so for TP, whose row-parallel sums add in another order)."""
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(1, steps + 1):
        x, y = _batch(step)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return _digest(model, opt)


def train_sharded(
    *,
    parallel: str,
    base: str,
    steps: int = 6,
    fault: str | None = None,
    fault_rank: int = 1,
    fault_step: int = 3,
    local: bool = True,
    local_dir: bool = True,
    persistent_every: int = 4,
    dcp_state: bool = False,
    remesh: bool = False,
    options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Train the sharded toy model for `steps` steps under @restartable, saving every step to the
    local tier (memory, `local_dir`: a node-local directory) and every `persistent_every` steps
    to the persistent tier. `fault` fires in iteration 0 on `fault_rank` once step `fault_step`
    is saved: "exception", "sigkill" (a reserve takes over), or "nan" (the loss of the next step's
    first attempt; the re-run machine re-runs that step in place). `dcp_state`: the state is a
    Stateful through get_state_dict / set_state_dict instead of {"model": m, "optim": opt}.
    `remesh`: after the restart the mesh is built with other dim names (a mismatch).

    Returns what each iteration restored with the digest of the state it restored, the digest
    saved at `fault_step`, the warnings logged and the final digest."""
    from restartable.checkpoint import CheckpointManager
    from restartable.inprocess import context, restartable
    from restartable.rerun import RerunDataIterator, RerunStateMachine

    warnings = _Warnings()
    logging.getLogger("restartable.inprocess").addHandler(warnings)
    logging.getLogger("restartable.checkpoint").addHandler(warnings)
    node = Path(base) / "local" / f"node{os.environ.get('GROUP_RANK', '0')}"
    node.mkdir(parents=True, exist_ok=True)
    mgr = CheckpointManager(
        f"{base}/persistent",
        persistent_every=persistent_every,
        keep=2,
        local_every=1 if local else None,
        local_dir=str(node) if local and local_dir else None,
        replication_factor=2 if local else None,
        timeout=30.0,
    )
    seen: list[dict[str, Any]] = []

    @restartable(**{**FAST, **(options or {})})
    def train() -> dict[str, Any]:
        ctx = context()
        rec: dict[str, Any] = {"iteration": ctx.iteration, "rank": ctx.rank}
        if ctx.last_restart is not None:
            rec["phases"] = dict(ctx.last_restart.phases)
        seen.append(rec)
        try:  # a failure here is a test failure: its message goes into the result
            model, _mesh = build(parallel, ctx.world_size, other_dims=remesh and ctx.iteration > 0)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            rsm = RerunStateMachine(mode="validate_results", check_for_nan_in_loss=True)
            state: dict[str, Any] = (
                {"train": DCPState(model, opt)} if dcp_state else {"model": model, "optim": opt}
            )
            start = mgr.load_latest(state) or 0
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {e}"
            raise
        restored = mgr.last_restore
        rec["restored"] = [start, restored.tier if restored else None]
        if start:
            rec["restored_digest"] = _digest(model, opt)
        loss = torch.tensor(0.0)
        for step in range(start + 1, steps + 1):
            ctx.ping(step=step)
            batches = RerunDataIterator(iter([_batch(step)]))
            attempts = 0
            while rsm.should_run_forward_backward(batches):
                attempts += 1
                opt.zero_grad()
                x, y = next(batches)
                loss = nn.functional.mse_loss(model(x), y)
                nan_due = fault == "nan" and step == fault_step + 1 and ctx.rank == fault_rank
                if nan_due and attempts == 1:
                    loss = loss * float("nan")
                loss.backward()
                rsm.validate_loss(loss)
            rec.setdefault("attempts", {})[step] = attempts
            opt.step()
            mgr.save(step, state)
            if ctx.iteration == 0 and step == fault_step:
                rec["saved_digest"] = _digest(model, opt)
                if fault in ("exception", "sigkill"):
                    mgr.wait()
                    dist.barrier()
                    if ctx.rank == fault_rank:
                        if fault == "sigkill":
                            os.kill(os.getpid(), signal.SIGKILL)
                        raise RuntimeError("injected fault")
        mgr.wait()
        return {"digest": _digest(model, opt), "loss": float(loss.detach()), "rank": ctx.rank}

    try:
        result = train()
    finally:
        mgr.close()
    return {"result": result, "seen": seen, "warnings": warnings.messages, "pid": os.getpid()}
