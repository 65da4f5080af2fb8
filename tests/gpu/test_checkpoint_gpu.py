"""Persistent and node-local tiers with CUDA state: saved through host buffers, restored onto the
GPU bit for bit, in one process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from restartable.checkpoint import CheckpointManager

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 8)
    ).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(3):
        model(torch.randn(32, 64, device="cuda")).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = [p.detach().clone() for p in model.parameters()]
    for s in opt.state.values():
        tensors += [v.clone() for v in s.values() if isinstance(v, torch.Tensor)]
    return tensors


def _assert_restored(
    model: torch.nn.Module, opt: torch.optim.Optimizer, want: list[torch.Tensor]
) -> None:
    got = _snapshot(model, opt)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.device == w.device, (g.device, w.device)  # back on the GPU (or CPU scalars)
        assert g.dtype == w.dtype and torch.equal(g, w)  # bit for bit
    assert all(p.is_cuda for p in model.parameters())


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model, "optim": opt, "step": 0}


def test_persistent_tier_saves_cuda_state_and_restores_it_onto_the_gpu(tmp_path: Path) -> None:
    model, opt = _trained(0)
    want = _snapshot(model, opt)
    with CheckpointManager(str(tmp_path), persistent_every=1) as mgr:
        mgr.save(7, _state(model, opt))
        # Mutated as soon as save() returns: the checkpoint holds the state of the call.
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        mgr.wait()
        assert [c.step for c in mgr.committed()] == [7]
        path = mgr.committed()[-1].path

    model2, opt2 = _trained(1)  # other values, same layout, on the GPU
    state2 = _state(model2, opt2)
    with CheckpointManager(str(tmp_path), persistent_every=1) as mgr:
        assert mgr.load_latest(state2) == 7
        assert mgr.last_restore is not None and mgr.last_restore.tier == "persistent"
    _assert_restored(model2, opt2, want)

    # Plain DCP reads the same checkpoint into CUDA tensors.
    model3, _ = _trained(2)
    plain = {"model": model3.state_dict()}
    dcp.load(plain, checkpoint_id=path)
    for k, v in model2.state_dict().items():
        assert plain["model"][k].is_cuda and torch.equal(plain["model"][k], v), k


def test_local_tier_restores_cuda_state_from_memory_and_from_the_node_directory(
    tmp_path: Path,
) -> None:
    # A new manager (as after the process's death) finds the step in the node-local directory
    # and copies it onto the GPU.
    model, opt = _trained(0)
    want = _snapshot(model, opt)
    local = tmp_path / "local"
    local.mkdir()
    kw: dict[str, Any] = {"persistent_every": 1000, "local_every": 1, "local_dir": str(local)}
    with CheckpointManager(str(tmp_path / "persistent"), **kw) as mgr:
        mgr.save(5, _state(model, opt))
        mgr.wait()
        # The memory copy first: the restore in the same process.
        model1, opt1 = _trained(1)
        state1 = _state(model1, opt1)
        assert mgr.load_latest(state1) == 5
        assert mgr.last_restore is not None and mgr.last_restore.tier == "memory"
        _assert_restored(model1, opt1, want)

    model2, opt2 = _trained(2)
    state2 = _state(model2, opt2)
    with CheckpointManager(str(tmp_path / "persistent"), **kw) as mgr:
        assert mgr.load_latest(state2) == 5
        assert mgr.last_restore is not None and mgr.last_restore.tier == "local_dir"
    _assert_restored(model2, opt2, want)
