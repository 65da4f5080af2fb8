"""Rank functions for tests/dist/test_sdc_quarantine.py (run through tests/multiproc.py).

A small data-parallel job over gloo (gradients all-reduced by hand, bitwise deterministic on
CPU) saves every step to the local tier (memory + a node-local directory) and every 2 steps to
the persistent tier. ``corrupt_from``: rank 1 flips a mantissa bit of one local gradient from
that step on (what ``sdc@rank1:stepN`` does), so every replica and every checkpoint after it is
corrupt. ``found_at``: the finding is settled there and the job told to distrust every step
after ``trusted`` (``CheckpointManager.quarantine_after``, as ``Scrubber(checkpoints=mgr)``
does), then:

* ``then="restart"``: the restart's load (the rollback), a later fault before any save (a
  second load), and training on to the end;
* ``then="crash"``: the job dies before its restart (the process exits); a second job (a
  requeue, ``then="resume"``) resumes from the same directories and trains on to the end.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from tests.dist.workers_persistent import Counter

FINDING = {"rank": 1, "host": "test", "step": 40, "verdict": "persistent", "detected_at": 46}


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, corrupt: bool) -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = _batch(step, rank)
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if corrupt:  # a faulty chip: one mantissa bit of the largest element of a local gradient
        g = grads[0].view(-1)
        bits = g.view(torch.int32)
        bits[int(g.abs().argmax())] ^= 1 << 20
    for g in grads:
        dist.all_reduce(g)
        g.div_(world)
    opt.step()
    out = loss.detach().clone()
    dist.all_reduce(out)
    return float(out) / world


def run(
    root: str,
    local_dir: str,
    *,
    steps: int,
    then: str,
    corrupt_from: int | None = None,
    found_at: int | None = None,
    trusted: int | None = None,
) -> dict[str, Any]:
    from restartable.checkpoint import CheckpointManager

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    counter = Counter(0)
    state = {"model": model, "optim": opt, "step": counter}
    mgr = CheckpointManager(
        root, persistent_every=2, keep=3, local_every=1, local_dir=local_dir, local_keep=2
    )
    loads: list[int | None] = []

    def load() -> int:
        loads.append(mgr.load_latest(state))
        return counter.value if loads[-1] is not None else 0

    start = load()
    loss = float("nan")
    step = start
    while step < steps:
        if found_at is not None and step == found_at:
            assert trusted is not None
            mgr.quarantine_after(trusted, finding={**FINDING, "rollback_to": trusted})
            found_at = corrupt_from = None  # the faulty rank is retired: no corruption since
            if then == "crash":
                mgr.close()  # the job dies before its restart: nothing reloads here
                dist.destroy_process_group()
                return {"rank": rank, "loads": loads, "loss": None, "step": step}
            step = load()  # the restart after the finding: the rollback
            step = load()  # a later fault before any save: restore again
            continue
        corrupt = corrupt_from is not None and step >= corrupt_from and rank == 1
        loss = _step(model, opt, step, corrupt)
        step += 1
        counter.value = step
        mgr.save(step, state)
    mgr.wait()
    mgr.close()
    dist.destroy_process_group()
    return {"rank": rank, "loads": loads, "loss": loss, "step": step}
