"""A step's result as one digest (its local gradients and its loss, bitwise), and the
re-computation of a step on a module from given parameters, batch and RNG state.

The digest is SHA-256 over each parameter's name and local gradient bytes (in
``named_parameters`` order) and the loss's bytes: two computations agree only when every bit
agrees, which holds for a deterministic step (the scrubber verifies that at its first check).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import Any

import torch

Compute = Callable[[torch.nn.Module, Any], torch.Tensor]  # (module, batch) -> loss


def tensor_bytes(t: torch.Tensor) -> bytes:
    flat = t.detach().to("cpu").contiguous().view(-1)
    return bytes(flat.view(torch.uint8).numpy().tobytes())


def digest(grads: Mapping[str, torch.Tensor | None], loss: torch.Tensor) -> str:
    """SHA-256 (hex) of ``grads`` (name -> local gradient; None: no gradient) and ``loss``."""
    h = hashlib.sha256()
    for name, grad in grads.items():
        h.update(name.encode() + b"\0")
        h.update(b"-" if grad is None else tensor_bytes(grad))
    h.update(b"loss\0" + tensor_bytes(loss))
    return h.hexdigest()


def module_grads(module: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: p.grad for n, p in module.named_parameters() if p.requires_grad}


class Captured:
    """The local gradients of the backward passes run while it is open (the last pass wins),
    copied as each is computed, before a wrapper such as DDP averages them across ranks. Hooks
    added after a fault injector's see its corruption, as a real all-reduce would."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.grads: dict[str, torch.Tensor | None] = {}
        self._handles = []
        for name, p in module.named_parameters():
            if p.requires_grad:
                self.grads[name] = None
                self._handles.append(p.register_hook(self._keeper(name)))

    def _keeper(self, name: str) -> Callable[[torch.Tensor], None]:
        def keep(grad: torch.Tensor) -> None:
            self.grads[name] = grad.detach().clone()

        return keep

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def params_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of ``module``'s parameters (the state a step starts from)."""
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def recompute(
    module: torch.nn.Module,
    compute: Compute,
    batch: Any,
    rng: torch.Tensor,
    params: Mapping[str, torch.Tensor] | None = None,
) -> str:
    """Run ``compute(module, batch)`` and its backward pass again from ``params`` (None: the
    module's current ones) and the CPU RNG state ``rng``; the digest of the result.

    The module's parameters and gradients are put back afterwards, bit for bit, as is the
    caller's RNG state: a check leaves training exactly where it was.
    """
    named = dict(module.named_parameters())
    saved_grads = {n: p.grad for n, p in named.items()}
    saved_params = {n: named[n].detach().clone() for n in params} if params else {}
    try:
        with torch.no_grad():
            for n, value in (params or {}).items():
                named[n].copy_(value)
        for p in named.values():
            p.grad = None
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(rng)
            loss = compute(module, batch)
            loss.backward()
        return digest(module_grads(module), loss)
    finally:
        with torch.no_grad():
            for n, value in saved_params.items():
                named[n].copy_(value)
        for n, p in named.items():
            p.grad = saved_grads[n]
