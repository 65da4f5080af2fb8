"""Local tier with CUDA state: pinned staging, snapshot semantics, restore onto the GPU."""

from __future__ import annotations

import pytest
import torch

from checkpoint.local import LocalTier

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


class NoGroup:
    """Not distributed: world of one (the tier's group protocol)."""

    generation = 0
    token = None

    def current(self) -> None:
        return None

    def is_stale(self) -> bool:
        return False

    def drop(self) -> None:
        pass


def test_cuda_state_round_trip_is_a_snapshot() -> None:
    w = torch.randn(1 << 20, device="cuda")
    v = torch.randn(64, 64, device="cuda").t()  # strided
    state = {"w": w, "v": v, "step": 3}
    want_w, want_v = w.clone(), v.clone()
    with LocalTier(
        local_dir=None, replication_factor=1, algo="atomic", keep=1, group=NoGroup()
    ) as tier:
        tier.save(3, state)
        w.add_(1.0)  # mutated right after save() returns
        v.zero_()
        tier.wait()
        assert all(s.buf.is_pinned() for s in tier._held.values())
        res = tier.load(state, min_step=None)
    assert res is not None and res.tier == "memory"
    assert state["w"] is w and w.is_cuda
    assert torch.equal(w, want_w) and torch.equal(v, want_v)
