"""Local tier with CUDA state: pinned staging, snapshot semantics, restore onto the GPU."""

from __future__ import annotations

import pytest
import torch

from restartable.checkpoint.local import LocalTier
from tests.no_group import NoGroup

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


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


def test_a_cuda_model_saved_every_step_from_the_walk_memo_stays_exact() -> None:
    """A model's state on the GPU (enough tensors for the save's walk memo to replay it as one
    block), saved at every step while training changes it: each restore gives the step's
    values, and a parameter moved to the host in place (``.data =``) is still saved."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(6)]).cuda()
    sd = model.state_dict(keep_vars=True)  # the same dict at every save, as a cached one is
    state = {"model": sd, "step": 0}
    with LocalTier(
        local_dir=None, replication_factor=1, algo="atomic", keep=1, group=NoGroup()
    ) as tier:
        for step in range(1, 6):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.5)
            state["step"] = step
            want = {k: v.detach().clone() for k, v in sd.items()}
            tier.save(step, state)
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(3.0)  # after save() returns: must not reach the saved copy
            res = tier.load(state, min_step=step)
            assert res is not None and res.step == step
            assert all(torch.equal(sd[k], want[k]) for k in want)
        first = model[0].weight
        first.data = first.data.cpu()  # the same Parameter, now on the host
        tier.save(6, state)
        first.data.zero_()
        assert tier.load(state, min_step=6) is not None
        assert not first.is_cuda and torch.equal(first, want["0.weight"].cpu())


def test_overlapped_saves_every_step_equal_the_synchronous_snapshot_of_each_step() -> None:
    """LocalConfig(overlap_copy=True): the copy runs on a side stream behind the next forward
    and backward; each step's snapshot equals the synchronous snapshot of the same step, also
    for the step whose train() is abandoned between the copy and its end event."""
    import copy

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(256, 1024, device="cuda")

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 0}
    kw = dict(local_dir=None, replication_factor=1, algo="atomic", keep=2, group=NoGroup())
    with LocalTier(**kw, overlap=True) as tier, LocalTier(**kw) as sync_tier:
        for n in range(1, 9):
            state["step"] = n
            sync_tier.save(n, state)
            tier.save(n, state)
            if n < 8:
                step()  # its forward overlaps the copy; its optimizer step waits for it
            want = copy.deepcopy(state)
            assert sync_tier.load(want, min_step=n) is not None
            got = copy.deepcopy(state)
            res = tier.load(got, min_step=n)  # n == 8: abandoned before any guard
            assert res is not None and res.step == n
            for k in want["model"]:
                assert torch.equal(got["model"][k], want["model"][k]), (n, k)
