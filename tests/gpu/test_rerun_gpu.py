"""The re-run state machine on a loss computed on the GPU: NaN caught, the step replayed bit for
bit (CUDA RNG included), and no device sync until the machine reads its checks."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from restartable.rerun import Diagnostic, RerunDataIterator, RerunErrorInjector, RerunStateMachine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _batches(nan_at: int | None = None) -> Iterator[torch.Tensor]:
    for i in range(1000):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(64, 32, generator=g)
        if i == nan_at:
            x[0, 0] = math.nan
        yield x.cuda()


class Loop:
    """A training loop on the GPU whose step draws from the CUDA RNG (dropout)."""

    def __init__(self, rsm: RerunStateMachine, data: Iterator[torch.Tensor]) -> None:
        torch.manual_seed(0)
        self.rsm = rsm
        self.model = torch.nn.Sequential(
            torch.nn.Linear(32, 128), torch.nn.Dropout(0.5), torch.nn.Linear(128, 1)
        ).cuda()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.data = RerunDataIterator(data)
        self.passes: list[tuple[int, float]] = []
        self.reject_at: int | None = None

    def run(self, steps: int) -> tuple[bool, bool, int]:
        decision: tuple[bool, bool, int] = (False, False, 0)
        for _ in range(steps):
            while self.rsm.should_run_forward_backward(self.data):
                self.opt.zero_grad()
                loss = self.model(next(self.data)).pow(2).mean()
                assert loss.is_cuda
                loss.backward()
                self.rsm.validate_loss(loss)
                if self.reject_at is not None:
                    rejected = self.rsm.iteration == self.reject_at
                    self.rsm.validate_result(loss, lambda v, r=rejected: r, "forced", fatal=True)
                self.passes.append((self.rsm.iteration, loss.item()))
            decision = self.rsm.should_checkpoint_and_exit()
            if decision[1]:
                break
            self.opt.step()
        return decision


def _machine(injected: str | None = None, **kw: Any) -> RerunStateMachine:
    inj = RerunErrorInjector(injected, at=[(0, 3)]) if injected else None
    return RerunStateMachine(
        "validate_results", error_injector=inj, hardware_id="gpu-a", in_job=False, **kw
    )


def test_nan_in_the_data_is_caught_replayed_and_reproduced() -> None:
    loop = Loop(_machine(), _batches(nan_at=2))
    assert loop.run(5) == (True, True, 16)  # reproducible: checkpoint, settle elsewhere
    assert [p[0] for p in loop.passes] == [1, 2, 3, 3]
    assert math.isnan(loop.passes[2][1]) and math.isnan(loop.passes[3][1])


def test_transient_nan_is_told_from_a_reproducible_one() -> None:
    loop = Loop(_machine("transient_error"), _batches())
    assert loop.run(5) == (False, True, 17)
    assert loop.rsm.verdict is Diagnostic.TRANSIENT_ERROR
    assert [p[0] for p in loop.passes] == [1, 2, 3, 3]


def test_rejected_finite_loss_replays_bit_identically_with_cuda_dropout() -> None:
    # Equal with tolerance 0 only if the CUDA RNG (dropout) and the microbatch are replayed.
    loop = Loop(_machine(), _batches())
    loop.reject_at = 2
    assert loop.run(5) == (True, True, 16)
    (it1, loss1), (it2, loss2) = loop.passes[1], loop.passes[2]
    assert it1 == it2 == 2
    assert loss1 == loss2


def test_checks_make_no_device_sync_until_the_machine_reads_them() -> None:
    loop = Loop(_machine(check_for_spiky_loss=True, spiky_loss_warmup=1), _batches())
    loop.run(2)  # past warm-up
    rsm = loop.rsm
    data = RerunDataIterator(iter([torch.randn(64, 32, device="cuda")]))
    assert rsm.should_run_forward_backward(data)
    loss = loop.model(next(data)).pow(2).mean()
    torch.cuda.set_sync_debug_mode("error")  # a device-to-host sync raises
    try:
        rsm.validate_loss(loss)
        rsm.validate_result(loss, torch.isnan, "nan")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not rsm.should_run_forward_backward(data)  # reads them: one sync
