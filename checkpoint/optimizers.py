"""Optimizers that have not stepped yet get their state tensors before a load fills them.

A ``torch.optim`` optimizer creates its state (Adam's moments, SGD's momentum) in its first
``step()``; until then its ``state_dict()`` lists none, so a load into one, by any tier, would
fill nothing and training would go on from zero moments. Restoring into a fresh optimizer is
what every restart does when ``train()`` builds its optimizer anew.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

log = logging.getLogger(__name__)


def prepare(state: Mapping[str, Any]) -> list[torch.optim.Optimizer]:
    """Give each optimizer of ``state`` that has no state yet its state tensors; return them.

    The state comes from one ``step()`` with a learning rate of 0 on zero gradients (what
    ``torch.distributed.checkpoint.state_dict`` does for the same reason): the parameters do not
    change, and gradients and learning rates are put back. A load then overwrites the state;
    when nothing was loaded, ``forget()`` empties it again. Main thread, before a load.
    """
    fresh = []
    for opt in _optimizers(state, []):
        if opt.state:
            continue
        try:
            _step_at_lr_zero(opt)
        except Exception as e:  # e.g. LBFGS needs a closure: its state stays as it is
            log.warning(
                "checkpoint: could not create the state of %s before loading (%s: %s): its "
                "saved state will not be restored; step it once before load_latest()",
                type(opt).__name__,
                type(e).__name__,
                e,
            )
            opt.state.clear()
            continue
        fresh.append(opt)
    return fresh


def forget(optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """Undo ``prepare`` where nothing was loaded: the optimizers start from no state again."""
    for opt in optimizers:
        opt.state.clear()


def _optimizers(obj: Any, out: list[torch.optim.Optimizer]) -> list[torch.optim.Optimizer]:
    if isinstance(obj, torch.optim.Optimizer):
        out.append(obj)
    elif isinstance(obj, Mapping):
        for v in obj.values():
            _optimizers(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _optimizers(v, out)
    return out


def _step_at_lr_zero(opt: torch.optim.Optimizer) -> None:
    params = [p for group in opt.param_groups for p in group["params"]]
    grads = [p.grad for p in params]
    lrs = [group.get("lr") for group in opt.param_groups]
    try:
        for p in params:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
        for group in opt.param_groups:
            if isinstance(group.get("lr"), torch.Tensor):
                group["lr"] = torch.zeros_like(group["lr"])
            elif "lr" in group:
                group["lr"] = 0.0
        opt.step()
    finally:
        for group, lr in zip(opt.param_groups, lrs, strict=True):
            if lr is not None:
                group["lr"] = lr
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad
