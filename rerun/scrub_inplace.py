"""In-place scrubbing: every rank re-computes its own sampled step on its own device.

Catches TRANSIENT faults only: a fault that repeats on every computation of the device (a
deterministic faulty chip) gives the same wrong result twice, which looks correct. Every K-th
step each rank copies its local gradients as they are computed, re-computes the step from the
same state, batch and RNG state after the backward pass (before the optimizer step) and
compares the digests; a mismatch is settled by a third computation (2 of 3). The ranks then
agree (one MAX all-reduce of one int per rank, on sampled steps only): when a rank's first
result was the odd one out, its corrupt gradient is already in every replica's all-reduced
gradient, so every rank restarts from the checkpoint of the state before this step.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from restartable.rerun import agree
from restartable.rerun.sdc_digest import Compute, digest, recompute

logger = logging.getLogger(__name__)

OK, ROLLBACK, NONDETERMINISTIC = 0, 1, 2


def check_own_step(
    module: torch.nn.Module,
    compute: Compute,
    *,
    batch: Any,
    rng: torch.Tensor,
    first: str,
    verify: bool,
) -> tuple[int, tuple[str, ...]]:
    """Re-compute the step just computed (``first``: its digest) on ``module``, whose
    parameters are still the pre-step ones; ``verify``: compute twice even on agreement (the
    determinism check of the first sampled step). Returns (code, digests)."""
    second = recompute(module, compute, batch, rng)
    if second == first and not verify:
        return OK, (first, second)
    third = recompute(module, compute, batch, rng)
    digests = (first, second, third)
    if second == third:
        return (OK if first == second else ROLLBACK), digests
    if first == third:  # the re-computation blinked, not the step that trained
        logger.warning("sdc scrubbing: a re-computation differed from two others (transient)")
        return OK, digests
    return NONDETERMINISTIC, digests


def first_digest(grads: dict[str, torch.Tensor | None], loss: torch.Tensor) -> str:
    return digest(grads, loss)


def agree_codes(code: int, *, rank: int, world: int) -> list[int]:
    """Every rank's code (MAX all-reduce of a one-hot vector)."""
    vec = torch.zeros(world, dtype=torch.int32, device=agree.comm_device())
    vec[rank] = code
    agree.reduce_max_(vec)
    return [int(v) for v in vec.tolist()]
