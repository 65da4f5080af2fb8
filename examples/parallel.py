"""How the example shards its GPT: DDP (default), FSDP2, tensor parallel or HSDP.

Each function runs inside ``train()``, in every restart iteration, on the group that iteration
created: the mesh, the sharded model and the optimizer are built afresh, and the checkpoint
brings their state back (the framework releases what torch kept of the old groups).
"""

from __future__ import annotations

import torch
from gpt import GPT
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel as DDP

CHOICES = ("ddp", "fsdp", "tp", "hsdp")


def shard(model: GPT, parallel: str, *, world: int, device: torch.device) -> nn.Module:
    """The module to train: `model` wrapped (DDP) or sharded in place (FSDP2, TP, HSDP)."""
    kind = device.type
    if parallel == "ddp":
        # find_unused_parameters=True: DDP never rebuilds its buckets. By default it rebuilds
        # them after its first backward, and a run restarted in process (a new DDP) reduced its
        # first step before that rebuild: the gradients came out a few bits off the clean run's
        # (final loss 2.0418670177 vs 2.0418672562 after one restart at step 40 of 50; a
        # bucket_cap_mb_list does not help). Without the rebuild a restarted run is bit-identical
        # to a clean one. Cost: one walk of the autograd graph per step, and torch's one-line
        # warning per rank that it found no unused parameter.
        return DDP(
            model, device_ids=[device] if kind == "cuda" else None, find_unused_parameters=True
        )
    if parallel == "tp":
        # Each block's MLP is split across the ranks (column- then row-wise); attention,
        # embeddings and norms stay whole on every rank, which all train on the same batch.
        mesh = init_device_mesh(kind, (world,), mesh_dim_names=("tp",))
        for block in model.blocks:
            plan = {"mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()}
            parallelize_module(block, mesh, plan)  # type: ignore[arg-type]
        return model
    if parallel == "fsdp":
        mesh = init_device_mesh(kind, (world,), mesh_dim_names=("dp",))
    elif parallel == "hsdp":
        # Shard within pairs of ranks, replicate across the pairs (one rank: a 1 x 1 mesh).
        inner = 2 if world % 2 == 0 else 1
        mesh = init_device_mesh(
            kind, (world // inner, inner), mesh_dim_names=("replicate", "shard")
        )
    else:
        raise ValueError(f"parallel ({parallel!r}) must be one of {', '.join(CHOICES)}")
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def data_rank(parallel: str, rank: int) -> int:
    """Whose batch this rank trains on: its own, except under TP (one batch for the group)."""
    return 0 if parallel == "tp" else rank
