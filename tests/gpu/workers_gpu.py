"""Rank functions of the GPU tests (run through tests.multiproc.run_ranks).

One GPU holds one NCCL rank of a communicator, so the NCCL jobs here have one rank; jobs of
several ranks share the GPU over gloo, which reduces CUDA tensors through host memory.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests.dist.workers_inprocess import FAST

HANG_S = 60.0  # a hang that only the restart ends
# CUDA's and NCCL's set-up are single C calls of a second or more: room for them.
SOFT_TIMEOUT_S = 5.0
OPTIONS = {**FAST, "soft_timeout": SOFT_TIMEOUT_S, "hard_timeout": 20.0}  # backend: gloo


def _nccl_groups() -> int:
    """The process groups of this rank that hold an NCCL backend."""
    n = 0
    for pg in list(dist.distributed_c10d._world.pg_map):
        try:
            pg._get_backend(torch.device("cuda"))
        except Exception:
            continue
        n += 1
    return n


def nccl_fault_then_all_reduce(*, fault: str) -> dict[str, Any]:
    """One rank, NCCL, CUDA tensors: in iteration 0 an all_reduce, then ``fault`` ("raise": an
    exception; "hang": a sleep with the GIL released, past soft_timeout). Iteration 1 must run
    in the same process on a new communicator. Records, per call of the NCCL abort, how many
    NCCL groups it found (the abort of ``inprocess.restart.abort`` calls ncclCommAbort on each)."""
    from restartable.inprocess import context, restartable
    from restartable.inprocess.restart import abort as abort_module

    logging.basicConfig(level=logging.INFO, format="%(relativeCreated)d %(name)s: %(message)s")
    # "NCCL abort failed: ..."
    logging.getLogger("restartable.inprocess.restart.abort").setLevel(logging.DEBUG)
    aborted: list[int] = []
    abort_nccl = abort_module._abort_nccl

    def counted_abort() -> None:
        aborted.append(_nccl_groups())
        abort_nccl()

    abort_module._abort_nccl = counted_abort  # looked up at call time by abort_process_groups
    seen: list[dict[str, Any]] = []

    @restartable(**{**OPTIONS, "backend": "nccl"})
    def train() -> dict[str, Any]:
        ctx = context()
        device = torch.device("cuda", torch.cuda.current_device())
        t = torch.full((1 << 16,), float(ctx.iteration + 1), device=device)
        dist.all_reduce(t)
        value = float(t.sum().item())  # waits for the NCCL kernel
        seen.append(
            {
                "iteration": ctx.iteration,
                "sum": value,
                "backend": str(dist.get_backend()),
                "nccl_groups": _nccl_groups(),
                "aborts_before": list(aborted),
            }
        )
        if ctx.iteration == 0:
            if fault == "raise":
                raise RuntimeError("injected fault after an NCCL all_reduce")
            t0 = time.monotonic()
            try:
                time.sleep(HANG_S)  # GIL released: the soft timeout must end it
            finally:
                seen[-1]["hang_interrupted_after"] = time.monotonic() - t0
        return {"sum": value, "iteration": ctx.iteration}

    result = train()
    return {"pid": os.getpid(), "seen": seen, "aborted": aborted, "result": result}


STEPS = 8
FAULT_STEP = 5  # rank 1 raises in iteration 0 once every rank saved step 5 (state.step 5)


def gloo_cuda_training(*, root: str, fault: bool) -> dict[str, Any]:
    """Two ranks on one GPU over gloo: DDP of a CUDA model, every step saved to the local tier
    (memory) and every 3rd to the persistent tier. With ``fault`` rank 1 raises at FAULT_STEP
    of iteration 0; iteration 1 restores onto the GPU and trains to STEPS. Returns the final
    parameters (as lists) and where each iteration started from."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from restartable.checkpoint import CheckpointManager
    from restartable.inprocess import context, restartable

    logging.basicConfig(level=logging.INFO, format="%(relativeCreated)d %(name)s: %(message)s")
    mgr = CheckpointManager(
        str(Path(root) / "persistent"), persistent_every=3, keep=2, local_every=1, timeout=60.0
    )
    starts: list[dict[str, Any]] = []

    @restartable(**OPTIONS)  # gloo: several ranks share the one GPU
    def train() -> list[list[float]]:
        ctx = context()
        device = torch.device("cuda", 0)
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)
        ).to(device)
        ddp = DDP(model, device_ids=[device])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        state = {"model": model, "optim": opt, "step": 0}
        mgr.load_latest(state)
        restore = mgr.last_restore
        starts.append(
            {
                "iteration": ctx.iteration,
                "step": state["step"],
                "tier": None if restore is None else restore.tier,
                "on_gpu": all(p.is_cuda for p in model.parameters())
                and all(v.is_cuda for s in opt.state.values() for v in s.values() if v.dim() > 0),
            }
        )
        for step in range(int(state["step"]), STEPS):
            ctx.ping(step)
            g = torch.Generator(device=device).manual_seed(1000 * step + ctx.rank)
            x = torch.randn(16, 32, device=device, generator=g)
            opt.zero_grad(set_to_none=True)
            ddp(x).square().mean().backward()
            opt.step()
            state["step"] = step + 1
            mgr.save(step + 1, state)
            if fault and ctx.iteration == 0 and step + 1 == FAULT_STEP:
                # Both ranks hold step FAULT_STEP before rank 1 raises: without the barrier
                # rank 1's fault could interrupt rank 0's save of it (a restore of the step
                # before, as the tier guarantees, but not the step this test expects).
                mgr.wait()
                dist.barrier()
                if ctx.rank == 1:
                    raise RuntimeError("injected fault on rank 1")
        mgr.wait()
        return [p.detach().cpu().flatten().tolist() for p in model.parameters()]

    try:
        params = train()
    finally:
        mgr.close()
    return {"pid": os.getpid(), "starts": starts, "params": params}


SHARDED_TIERS = ("memory", "local_dir", "persistent")


def fsdp_nccl_training(*, root: str, fault: bool, tier: str) -> dict[str, Any]:
    """One CUDA rank over NCCL training an MLP sharded with FSDP2 (``fully_shard`` on each Linear
    and on the root, a 1-rank mesh on the GPU), saved every step to ``tier``:

    - "memory": the local tier in host memory (one manager for the job);
    - "local_dir": the local tier with a node-local directory, the manager built anew in every
      iteration, as in a new process, so only the directory holds the saved step;
    - "persistent": the torch_dist tier only.

    With ``fault`` the rank raises at FAULT_STEP of iteration 0 once that step's save committed;
    iteration 1 builds the model, mesh and optimizer anew and restores. Returns where each
    iteration started from, whether the restored state is DTensors on the GPU, the restart's
    barrier time, and the final parameters (gathered, as lists)."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from restartable.checkpoint import CheckpointManager
    from restartable.inprocess import context, restartable

    if tier not in SHARDED_TIERS:
        raise ValueError(f"tier={tier!r}: use one of {SHARDED_TIERS}")
    logging.basicConfig(level=logging.INFO, format="%(relativeCreated)d %(name)s: %(message)s")
    local = Path(root) / "local"
    local.mkdir(parents=True, exist_ok=True)

    def manager() -> CheckpointManager:
        persistent = tier == "persistent"
        return CheckpointManager(
            str(Path(root) / "persistent"),
            persistent_every=1 if persistent else 1000,
            keep=2,
            local_every=None if persistent else 1,
            local_dir=str(local) if tier == "local_dir" else None,
            timeout=60.0,
        )

    job_manager = None if tier == "local_dir" else manager()
    starts: list[dict[str, Any]] = []

    @restartable(**{**OPTIONS, "backend": "nccl"})
    def train() -> list[list[float]]:
        ctx = context()
        device = torch.device("cuda", torch.cuda.current_device())
        torch.manual_seed(0)
        mesh = init_device_mesh("cuda", (ctx.world_size,), mesh_dim_names=("dp",))
        model = nn.Sequential(
            nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)
        ).to(device)
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        state = {"model": model, "optim": opt}
        mgr = job_manager or manager()
        try:
            start = mgr.load_latest(state) or 0
            restore = mgr.last_restore
            moments = [v for s in opt.state.values() for v in s.values() if v.dim() > 0]
            starts.append(
                {
                    "iteration": ctx.iteration,
                    "step": start,
                    "tier": None if restore is None else restore.tier,
                    "dtensors_on_gpu": all(
                        isinstance(t, DTensor) and t.to_local().is_cuda
                        for t in [*model.parameters(), *moments]
                    ),
                    "barrier_s": (
                        None if ctx.last_restart is None else ctx.last_restart.phases["barrier"]
                    ),
                }
            )
            for step in range(start + 1, STEPS + 1):
                ctx.ping(step)
                g = torch.Generator(device=device).manual_seed(1000 * step)
                x = torch.randn(16, 32, device=device, generator=g)
                opt.zero_grad(set_to_none=True)
                model(x).square().mean().backward()
                opt.step()
                mgr.save(step, state)
                if fault and ctx.iteration == 0 and step == FAULT_STEP:
                    mgr.wait()
                    raise RuntimeError("injected fault after a committed save")
            mgr.wait()
            return [p.full_tensor().cpu().flatten().tolist() for p in model.parameters()]
        finally:
            if job_manager is None:
                mgr.close()

    try:
        params = train()
    finally:
        if job_manager is not None:
            job_manager.close()
    return {"pid": os.getpid(), "starts": starts, "params": params}
