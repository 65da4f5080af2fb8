"""The built-in loss checks of ``validate_loss``: NaN/Inf (fatal) and spiky loss (non-fatal).

Built by ``RerunStateMachine`` (``rerun.machine``) from its constructor's arguments, which it
checks here; ``validate`` runs on the training loop's thread inside forward/backward, once per
``validate_loss`` call, and never blocks (a CUDA loss stays on its device).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from restartable.rerun.checks import LargeValueTracker, Rejection, Value, is_not_finite
from restartable.rerun.errors import RerunConfigError

NAN_LOSS_MESSAGE = "loss is NaN or Inf"
SPIKY_LOSS_MESSAGE = "Spiky loss"


class ValidateResult(Protocol):
    """``RerunStateMachine.validate_result``: where each check's verdict is recorded."""

    def __call__(
        self,
        value: Value,
        rejection_func: Callable[[Value], Rejection],
        message: str,
        *,
        tolerance: float = 0.0,
        fatal: bool = True,
    ) -> None: ...


class LossChecks:
    """Which loss checks run, and the spiky check's factor and warm-up.

    ``spiky_loss_factor`` (> 1) x the running max of the first ``spiky_loss_warmup`` (and later
    non-spiky) losses is spiky; the running max lives in ``large`` (the machine's
    ``LargeValueTracker``, which also serves ``is_unexpectedly_large`` and travels in
    ``state_dict``). Raises ``RerunConfigError`` for a factor <= 1 or a warm-up < 1.
    """

    def __init__(
        self,
        *,
        check_for_nan_in_loss: bool,
        check_for_spiky_loss: bool,
        spiky_loss_factor: float,
        spiky_loss_warmup: int,
        large: LargeValueTracker,
    ) -> None:
        if not (isinstance(spiky_loss_factor, (int, float)) and spiky_loss_factor > 1.0):
            raise RerunConfigError(
                f"spiky_loss_factor ({spiky_loss_factor!r}) must be a number greater than 1 "
                "(a loss is spiky when larger than factor x the running max): use e.g. 10.0"
            )
        if spiky_loss_warmup < 1:
            raise RerunConfigError(
                f"spiky_loss_warmup ({spiky_loss_warmup}) must be >= 1 (losses recorded before "
                "spikes are flagged): use e.g. 100"
            )
        self.check_for_nan_in_loss = check_for_nan_in_loss
        self.check_for_spiky_loss = check_for_spiky_loss
        self.spiky_loss_factor = float(spiky_loss_factor)
        self.spiky_loss_warmup = spiky_loss_warmup
        self._large = large

    def validate(self, loss: Value, validate_result: ValidateResult) -> None:
        """Run the enabled checks on ``loss`` through ``validate_result`` (the NaN check first).

        A CUDA loss stays on the device (no sync until the end of the pass); a CPU loss is read
        once as a float, since reading it costs no synchronisation and float checks are cheaper
        than a dozen small tensor operations.
        """
        if isinstance(loss, torch.Tensor) and loss.device.type == "cpu" and loss.numel() == 1:
            loss = float(loss.detach().item())
        if self.check_for_nan_in_loss:
            validate_result(loss, is_not_finite, NAN_LOSS_MESSAGE, tolerance=0.0, fatal=True)
        if self.check_for_spiky_loss:
            validate_result(loss, self._spiky, SPIKY_LOSS_MESSAGE, tolerance=0.0, fatal=False)

    def _spiky(self, value: Value) -> Rejection:
        return self._large.check(value, self.spiky_loss_factor, "loss", self.spiky_loss_warmup)
