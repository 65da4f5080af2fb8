"""Ranks that save a state with a per-rank value in and out of ``PerRank``
(tests/dist/test_rank_values.py)."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from restartable.checkpoint import CheckpointManager, PerRank


def save_twice(*, root: str, per_rank: bool) -> dict[str, Any]:
    """Two persistent saves of a state whose "rng" differs between ranks; the log's warnings."""
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    logging.getLogger("restartable.checkpoint").addHandler(Keep(level=logging.WARNING))
    dist.init_process_group("gloo", init_method="env://")
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)  # the same weights on every rank
    torch.manual_seed(dist.get_rank())
    rng = torch.get_rng_state()  # differs between ranks
    own: dict[str, Any] = {"own": PerRank(rng=rng)} if per_rank else {"rng": rng}
    state = {"model": model, "lr": 0.1, **own}
    with CheckpointManager(os.path.join(root, "ckpt"), persistent_every=1) as mgr:
        mgr.save(1, state)  # every rank leaves its fingerprints in the store
        dist.barrier()  # so that rank 0 finds them all at the next save
        mgr.save(2, state)
    dist.destroy_process_group()
    return {"warnings": seen}
