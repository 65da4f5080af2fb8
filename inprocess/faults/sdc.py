"""The ``sdc`` and ``sdc-once`` fault kinds applied: one mantissa bit of one element of a local
gradient flipped, before the all-reduce averages it into every replica (silent data corruption:
the loss stays finite, nothing visible goes wrong).

    flip = GradientBitFlip()
    flip.attach(model)                 # the module whose parameters the step differentiates
    ...
    due = faults.fire_planned(plan, step=step, record_dir=run_dir)
    if due is not None and due.kind == "sdc-once":
        flip.arm_once()                # the next backward pass only (a transient)
    if corrupting(run_dir):            # an ``sdc`` fired in this process: from now on
        flip.arm_lasting()             # every backward pass (a faulty chip)

The flip is a gradient hook on one parameter (the model's last), so it applies to every
backward pass that process runs through that module: a re-computation on the same process
reproduces the corruption (as a faulty chip would), one on another process does not. Attach it
before any other gradient hook that should see the corrupted value (hooks run in the order they
were registered). Imported on its own (``inprocess.faults`` stays torch-free).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from restartable.inprocess.faults.record import fired

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# The mantissa's top bit of each floating type (float32: bits 0..22): the flip changes the
# element by a factor between 1/2 and 3/2, large enough to move the training trajectory.
_TOP_MANTISSA_BIT = {
    "torch.float32": 22,
    "torch.float64": 51,
    "torch.float16": 9,
    "torch.bfloat16": 6,
}


def corrupting(record_dir: str | os.PathLike[str]) -> bool:
    """True once an ``sdc`` fault fired in this process (recorded in ``record_dir``).

    Reads the record file: call it at the start of ``train()`` and at the steps where an
    ``sdc`` is planned for this rank, not on every step. Survives in-process restarts (the
    record keeps the pid); a reserve that takes the rank's place is not corrupting.
    """
    me = os.getpid()
    return any(f.kind == "sdc" and f.pid == me for f in fired(record_dir))


def flip_bit_(grad: torch.Tensor, bit: int | None = None) -> int:
    """Flip mantissa bit ``bit`` (None: the top one) of the element of largest magnitude of
    ``grad`` in place; returns the flat index of the element."""
    import torch

    flat = grad.detach().view(-1)
    index = int(torch.argmax(flat.abs()).item())
    width = flat.element_size() * 8
    ints = {16: torch.int16, 32: torch.int32, 64: torch.int64}[width]
    top = _TOP_MANTISSA_BIT.get(str(flat.dtype))
    if top is None:
        raise TypeError(f"gradient dtype ({flat.dtype}) is not a floating type with a mantissa")
    as_int = flat.view(ints)
    as_int[index] ^= 1 << (top if bit is None else bit)
    return index


class GradientBitFlip:
    """Flips one mantissa bit of one element of the local gradient of one parameter."""

    def __init__(self, bit: int | None = None) -> None:
        self._bit = bit
        self._once = False
        self._lasting = False
        self.flips = 0  # how many gradients were corrupted in this process

    def attach(self, module: torch.nn.Module) -> None:
        """Hook the gradient of ``module``'s last parameter that requires one."""
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            raise ValueError(f"module ({type(module).__name__}) has no parameter to corrupt")
        params[-1].register_hook(self._hook)

    def arm_once(self) -> None:
        """Corrupt the next backward pass only (``sdc-once``)."""
        self._once = True

    def arm_lasting(self) -> None:
        """Corrupt every backward pass from now on (``sdc``)."""
        self._lasting = True

    @property
    def armed(self) -> bool:
        return self._once or self._lasting

    def _hook(self, grad: torch.Tensor) -> torch.Tensor:
        if not (self._once or self._lasting):
            return grad
        self._once = False
        out = grad.clone()
        index = flip_bit_(out, self._bit)
        self.flips += 1
        log.debug("sdc: flipped a mantissa bit of gradient element %d", index)
        return out
