"""Scripts whose runs must be told in true words (tests/dist/test_true_words.py).

    python -m restartable.launch --nproc-per-node 3 tests/dist/workers_words.py MODE [DIR]

Modes: ``dtensor`` (iteration 0: every rank calls an operator DTensor cannot shard, which
raises inside torch.distributed's code, the rank's own bug; ``user_code`` names the user's
frame); ``info`` (the root logger at INFO, as the TP example sets it; rank 1 raises once).
"""

from __future__ import annotations

import logging
import sys

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from restartable.inprocess import context, restartable

FAST = {
    "backend": "gloo",
    "soft_timeout": 5.0,
    "hard_timeout": 10.0,
    "barrier_timeout": 60.0,
    "completion_timeout": 60.0,
    "active_world_size": 2,
}


def user_code(x: torch.Tensor) -> torch.Tensor:
    return torch.nonzero(x)  # no sharding strategy for a DTensor: raises in DTensor's dispatch


def dtensor_mode() -> None:
    @restartable(**FAST)
    def train() -> None:
        ctx = context()
        mesh = init_device_mesh("cpu", (ctx.world_size,))
        x = distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)])
        if ctx.iteration == 0:
            user_code(x)
        print(f"iteration {ctx.iteration} rank {ctx.rank}: done", flush=True)

    train()


def info_mode() -> None:
    logging.basicConfig(level=logging.INFO)

    @restartable(**FAST)
    def train() -> None:
        ctx = context()
        if ctx.iteration == 0 and ctx.rank == 1:
            raise RuntimeError("once")
        ctx.ping(1)

    train()


if __name__ == "__main__":
    {"dtensor": dtensor_mode, "info": info_mode}[sys.argv[1]](*sys.argv[2:])
