"""Rank functions for the 2-rank re-run tests: a small training loop with checkpoints in files.

``train`` runs ``steps`` steps under a ``RerunStateMachine``; when the machine asks to
checkpoint it saves model, optimizer, data position and the machine's state per rank; when it
asks to exit it writes ``exit.<rank>.json`` (code, verdict, suspects, rank action) and calls
``exit_or_raise()``: standalone the process exits with 16 or 17 as a scheduler expects; with
``in_job`` the ``RerunExit`` propagates (exit status 1) after its raise time is recorded.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from restartable.rerun import RerunDataIterator, RerunErrorInjector, RerunExit, RerunStateMachine


def _batches(
    rank: int, start: int, nan_at: list[list[int]], spike_at: list[list[int]]
) -> Iterator[Any]:
    i = start
    while True:
        g = torch.Generator().manual_seed(rank * 100_003 + i)
        x = torch.randn(4, 8, generator=g)
        y = torch.randn(4, 1, generator=g)
        step = i + 1  # the machine counts iterations from 1
        if [rank, step] in nan_at:
            x[0, 0] = math.nan
        if [rank, step] in spike_at:
            y = y * 1e4
        yield x, y
        i += 1


def train(
    *,
    outdir: str,
    steps: int = 6,
    mode: str = "validate_results",
    inject: str | None = None,
    inject_at: list[list[int]] | None = None,
    forced_at: list[list[int]] | None = None,
    nan_at: list[list[int]] | None = None,
    spike_at: list[list[int]] | None = None,
    spiky: bool = False,
    warmup: int = 3,
    hardware: str = "a",
    resume: bool = False,
    save_at: int | None = None,
    in_job: bool = False,
) -> dict[str, Any]:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = Path(outdir)
    torch.manual_seed(1234 + rank)
    np.random.seed(rank)
    random.seed(rank)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.0 if spike_at else 0.01)
    injector = (
        RerunErrorInjector(inject, at=[tuple(a) for a in inject_at or []]) if inject else None
    )
    rsm = RerunStateMachine(
        mode,
        check_for_spiky_loss=spiky,
        spiky_loss_warmup=warmup,
        error_injector=injector,
        result_rejected_tracker_filename=str(out / "rejected.jsonl"),
        hardware_id=f"host{rank}-{hardware}",
        in_job=in_job,
    )
    consumed = 0
    ckpt_file = out / f"ckpt.{rank}.pt"
    if resume:
        ck = torch.load(ckpt_file, weights_only=False)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        rsm.load_state_dict(ck["rerun"])
        consumed = ck["consumed"]
        torch.set_rng_state(ck["torch_rng"])
    data = RerunDataIterator(_batches(rank, consumed, nan_at or [], spike_at or []))
    passes: list[list[Any]] = []
    forced = forced_at or []
    while rsm.iteration < steps:
        while rsm.should_run_forward_backward(data):
            opt.zero_grad()
            x, y = next(data)
            # Draws from torch (dropout), NumPy and Python RNGs: a re-run must replay all three.
            pred = model(x) + float(np.random.rand() * 1e-3) + random.random() * 1e-3
            loss = torch.nn.functional.mse_loss(pred, y)
            loss.backward()
            rsm.validate_loss(loss)
            if [rank, rsm.iteration] in forced:
                # Rejects the real, finite loss: reproducible only if replay is bit-identical.
                rsm.validate_result(loss, lambda v: True, "forced", fatal=True)
            passes.append([rsm.iteration, loss.item()])
        checkpoint, do_exit, _code = rsm.should_checkpoint_and_exit()
        if checkpoint or save_at == rsm.iteration:
            torch.save(
                {
                    "model": model.state_dict(),
                    "opt": opt.state_dict(),
                    "rerun": rsm.state_dict(),
                    # A pending re-run carries this step's microbatches: resume after them.
                    "consumed": consumed + 1,
                    "torch_rng": torch.get_rng_state(),
                },
                ckpt_file,
            )
        if do_exit:
            e = rsm.exit_exception()
            info = {
                "code": e.exit_code,
                "verdict": e.verdict,
                "suspect_ranks": list(e.suspect_ranks),
                "suspect_hardware": list(e.suspect_hardware),
                "action": e.restartable_rank_action,
                "checkpoint": checkpoint,
                "passes": passes,
            }
            (out / f"exit.{rank}.json").write_text(json.dumps(info))
            try:
                rsm.exit_or_raise()  # standalone: sys.exit(code); in_job: raises RerunExit
            except RerunExit as raised:
                info.update(
                    raised=True, raised_at=time.time(), action=raised.restartable_rank_action
                )
                (out / f"exit.{rank}.json").write_text(json.dumps(info))
                dist.destroy_process_group()  # what the @restartable wrapper's teardown does
                raise
        opt.step()
        consumed += 1
        if save_at == rsm.iteration:
            break
    result = {
        "passes": passes,
        "iteration": rsm.iteration,
        "verdict": rsm.verdict.value if rsm.verdict else None,
        "stats": rsm.determinism_stats(),
        "state": rsm.state_dict()["state"],
        "pid": os.getpid(),
    }
    # Tear down together: a peer closing its sockets while this rank still tears down its group
    # crashed gloo once here (SIGABRT, "terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()
    return result
