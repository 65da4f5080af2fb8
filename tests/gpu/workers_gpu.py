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
    from inprocess import context, restartable
    from inprocess.restart import abort as abort_module

    logging.basicConfig(level=logging.INFO, format="%(relativeCreated)d %(name)s: %(message)s")
    logging.getLogger("inprocess.restart.abort").setLevel(logging.DEBUG)  # "NCCL abort failed: ..."
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
FAULT_STEP = 5  # rank 1 raises here in iteration 0, after the save of step 5 (state.step 5)


def gloo_cuda_training(*, root: str, fault: bool) -> dict[str, Any]:
    """Two ranks on one GPU over gloo: DDP of a CUDA model, every step saved to the local tier
    (memory) and every 3rd to the persistent tier. With ``fault`` rank 1 raises at FAULT_STEP
    of iteration 0; iteration 1 restores onto the GPU and trains to STEPS. Returns the final
    parameters (as lists) and where each iteration started from."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from checkpoint import CheckpointManager
    from inprocess import context, restartable

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
            if fault and ctx.iteration == 0 and step == FAULT_STEP and ctx.rank == 1:
                raise RuntimeError("injected fault on rank 1")
            g = torch.Generator(device=device).manual_seed(1000 * step + ctx.rank)
            x = torch.randn(16, 32, device=device, generator=g)
            opt.zero_grad(set_to_none=True)
            ddp(x).square().mean().backward()
            opt.step()
            state["step"] = step + 1
            mgr.save(step + 1, state)
        mgr.wait()
        return [p.detach().cpu().flatten().tolist() for p in model.parameters()]

    try:
        params = train()
    finally:
        mgr.close()
    return {"pid": os.getpid(), "starts": starts, "params": params}
