"""Built-in checks: non-finite values, unexpectedly large values, and the relative comparison.

Each rejection function returns a bool or a 0-dim bool tensor on the value's device, so that a
step's checks can be batched into a single device-to-host read by the state machine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

Value = float | torch.Tensor
Rejection = bool | torch.Tensor


def as_float(value: Value) -> float:
    """A Python float (a device-to-host read for a tensor: used on the re-run path only)."""
    return (
        float(value.detach().reshape(()).item())
        if isinstance(value, torch.Tensor)
        else float(value)
    )


def is_not_finite(value: Value) -> Rejection:
    """True for NaN, +Inf or -Inf (no host sync for a tensor)."""
    if isinstance(value, torch.Tensor):
        return ~torch.isfinite(value.detach()).all()
    return not math.isfinite(value)


def compare_floats(a: float, b: float) -> float:
    """Relative difference: 0 if equal or both NaN, inf if only one is finite."""
    if a == b or (math.isnan(a) and math.isnan(b)):
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / ((abs(a) + abs(b)) / 2.0)


@dataclass
class _Running:
    count: int = 0
    max: Any = 0.0  # float, or a 0-dim tensor kept on the value's device


class LargeValueTracker:
    """The state behind ``is_unexpectedly_large``: per context, a count and a running max |v|."""

    def __init__(self) -> None:
        self._contexts: dict[str, _Running] = {}

    def check(self, value: Value, threshold: float, context: str, num_samples: int) -> Rejection:
        """Record |value|; after ``num_samples`` values, flag ``|value| >= threshold * max``.

        Non-finite values are neither flagged nor recorded (the NaN/Inf check owns them), and a
        flagged value does not raise the running max, so one spike does not hide the next.
        """
        run = self._contexts.setdefault(context, _Running())
        warm = run.count >= num_samples
        run.count += 1
        if isinstance(value, torch.Tensor):
            v = value.detach().reshape(()).abs().float()
            finite = torch.isfinite(v)
            cur = (
                run.max
                if isinstance(run.max, torch.Tensor)
                # A fill kernel, not a host-to-device copy (which would wait for the stream).
                else torch.full((), float(run.max), device=v.device)
            )
            if warm:
                flag = finite & (v >= cur * threshold)
                run.max = torch.where(finite & ~flag, torch.maximum(cur, v), cur)
                return flag
            run.max = torch.where(finite, torch.maximum(cur, v), cur)
            return False
        a = abs(float(value))
        cur_f = as_float(run.max)
        if not math.isfinite(a):
            return False
        if warm and a >= cur_f * threshold:
            return True
        run.max = max(cur_f, a)
        return False

    def state(self) -> dict[str, list[float]]:
        """``{context: [count, max]}`` as plain numbers (read at checkpoint time)."""
        return {k: [float(r.count), as_float(r.max)] for k, r in sorted(self._contexts.items())}

    def load(self, state: dict[str, list[float]]) -> None:
        self._contexts = {k: _Running(int(c), float(m)) for k, (c, m) in state.items()}
