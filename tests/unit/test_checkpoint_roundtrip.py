"""Single-process save/load behaviour of the persistent tier (the dist tests cover N ranks)."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from restartable.checkpoint import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointManager,
    CheckpointMismatchError,
)


class Counter:
    """A user object following DCP's Stateful protocol."""

    def __init__(self, value: int = 0) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"value": torch.tensor(self.value), "name": f"counter-{self.value}"}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.value = int(sd["value"])


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(4, 8)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer, counter: Counter) -> dict:
    return {"model": model.state_dict(), "optim": opt.state_dict(), "counter": counter, "lr": 0.5}


def test_round_trip_model_optimizer_scalars_stateful(tmp_path: Path) -> None:
    model, opt = _trained(0)
    counter = Counter(41)
    with CheckpointManager(str(tmp_path), persistent_every=10) as mgr:
        mgr.save(5, _state(model, opt, counter))  # not a multiple of 10: nothing saved
        mgr.save(10, _state(model, opt, counter))
        mgr.wait()
        assert [c.step for c in mgr.committed()] == [10]

    model2, opt2 = _trained(1)
    counter2 = Counter(0)
    state2 = _state(model2, opt2, counter2)
    state2["lr"] = 0.0
    with CheckpointManager(str(tmp_path), persistent_every=10) as mgr:
        assert mgr.load_latest(state2) == 10
        assert mgr.last_restore is not None and mgr.last_restore.tier == "persistent"
    for k, v in model.state_dict().items():
        torch.testing.assert_close(model2.state_dict()[k], v)
    for pid, s in opt.state_dict()["state"].items():
        torch.testing.assert_close(opt2.state_dict()["state"][pid]["exp_avg"], s["exp_avg"])
    assert counter2.value == 41
    assert state2["lr"] == 0.5


def test_empty_root_loads_nothing(tmp_path: Path) -> None:
    with CheckpointManager(str(tmp_path)) as mgr:
        assert mgr.load_latest({"x": torch.zeros(2)}) is None
        assert mgr.last_restore is not None and mgr.last_restore.tier is None


class ModelAndOptim:
    """Stateful through torch's get_state_dict, as in examples/train.py: on an optimizer without
    state, get_state_dict creates that state by taking a (zero learning rate) step."""

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model, self.opt = model, opt

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.opt)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(
            self.model, self.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"]
        )


@pytest.mark.parametrize("local", [False, True], ids=["persistent", "local_and_persistent"])
def test_nothing_to_load_leaves_a_fresh_optimizer_untouched(tmp_path: Path, local: bool) -> None:
    """A first run's load_latest finds nothing: the state must come out as it went in. A walk
    of the state would give Adam a step count of 1 and change the whole training trajectory."""
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    kw: dict[str, Any] = {"local_every": 1, "local_dir": None} if local else {}
    with CheckpointManager(str(tmp_path), **kw) as mgr:
        assert mgr.load_latest({"train": ModelAndOptim(model, opt)}) is None
    assert opt.state == {}


def test_mutation_after_save_returns_is_not_saved(tmp_path: Path) -> None:
    big = torch.zeros(1 << 20)
    small = [torch.zeros(3) for _ in range(50)]
    with CheckpointManager(str(tmp_path), persistent_every=1) as mgr:
        mgr.save(1, {"big": big, "small": small})
        big.fill_(7.0)  # the background write may still be running
        for t in small:
            t.fill_(7.0)
        mgr.wait()
        out = {"big": torch.ones(1 << 20), "small": [torch.ones(3) for _ in range(50)]}
        assert mgr.load_latest(out) == 1
    assert out["big"].abs().sum().item() == 0.0
    assert all(t.abs().sum().item() == 0.0 for t in out["small"])


def test_loads_with_plain_dcp_load(tmp_path: Path) -> None:
    model, _opt = _trained(0)
    with CheckpointManager(str(tmp_path), persistent_every=1) as mgr:
        mgr.save(3, {"model": model.state_dict()})
        mgr.wait()
        path = mgr.committed()[-1].path
    model2, _ = _trained(1)
    sd = {"model": model2.state_dict()}
    dcp.load(sd, checkpoint_id=path)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(sd["model"][k], v)


def test_staging_buffers_are_reused_between_saves(tmp_path: Path) -> None:
    x = torch.arange(1000.0)
    with CheckpointManager(str(tmp_path), persistent_every=1) as mgr:
        mgr.save(1, {"x": x})
        mgr.wait()
        pool = mgr._persistent._pool
        first = pool._views[("x",)].data_ptr()
        mgr.save(2, {"x": x + 1})
        mgr.wait()
        assert pool._views[("x",)].data_ptr() == first


def _corrupt_newest(root: Path, how: str) -> Path:
    newest = sorted(p for p in root.iterdir() if p.name.startswith("step_"))[-1]
    data = next(newest.glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    if how == "flip":
        raw[len(raw) // 2] ^= 0xFF
    else:
        raw = raw[: len(raw) // 2]
    data.write_bytes(bytes(raw))
    return data


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_corrupt_newest_falls_back_with_warning(
    tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    with CheckpointManager(str(tmp_path), persistent_every=1) as mgr:
        for step in (1, 2):
            mgr.save(step, {"x": torch.full((100,), float(step))})
        mgr.wait()
    bad = _corrupt_newest(tmp_path, how)
    out = {"x": torch.zeros(100)}
    with caplog.at_level(logging.WARNING), CheckpointManager(str(tmp_path)) as mgr:
        assert mgr.load_latest(out) == 1
    assert out["x"][0].item() == 1.0
    assert any(bad.name in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


def test_corruption_raises_when_fallback_disabled(tmp_path: Path) -> None:
    with CheckpointManager(str(tmp_path), persistent_every=1) as mgr:
        for step in (1, 2):
            mgr.save(step, {"x": torch.full((100,), float(step))})
        mgr.wait()
    bad = _corrupt_newest(tmp_path, "flip")
    with (
        CheckpointManager(str(tmp_path), fallback_on_corruption=False) as mgr,
        pytest.raises(CheckpointCorruptError, match=bad.name),
    ):
        mgr.load_latest({"x": torch.zeros(100)})


def test_mismatching_keys_and_shapes_are_listed(tmp_path: Path) -> None:
    with CheckpointManager(str(tmp_path), persistent_every=1) as mgr:
        mgr.save(1, {"a": torch.zeros(4), "b": torch.zeros(2, 2)})
        mgr.wait()
        wrong = {"a": torch.zeros(5), "b": torch.zeros(2, 2), "c": torch.zeros(1)}
        with pytest.raises(CheckpointMismatchError) as info:
            mgr.load_latest(wrong)
    assert info.value.keys == ["a", "c"]
    assert "(5,)" in str(info.value) and "(4,)" in str(info.value)
    assert wrong["b"].sum().item() == 0.0


def test_memory_filesystem_round_trip() -> None:
    root = f"memory://ckpt-test-{os.getpid()}"
    with CheckpointManager(root, persistent_every=1, keep=1) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"x": torch.full((10,), float(step))})
        mgr.wait()
        assert [c.step for c in mgr.committed()] == [3]
        out = {"x": torch.zeros(10)}
        assert mgr.load_latest(out) == 3
        assert out["x"][0].item() == 3.0


def test_skip_policy_skips_while_in_flight(tmp_path: Path) -> None:
    with CheckpointManager(str(tmp_path), persistent_every=1, on_busy="skip") as mgr:
        # Hold the writer thread so that step 1 is certainly still in flight at step 2.
        release = threading.Event()
        mgr._persistent._worker.submit(release.wait, 30)
        mgr.save(1, {"x": torch.zeros(10)})
        mgr.save(2, {"x": torch.ones(10)})
        release.set()
        mgr.wait()
        assert [c.step for c in mgr.committed()] == [1]
        out = {"x": torch.ones(10)}
        assert mgr.load_latest(out) == 1 and out["x"].sum().item() == 0.0


def test_wait_policy_saves_both(tmp_path: Path) -> None:
    with CheckpointManager(str(tmp_path), persistent_every=1) as mgr:
        release = threading.Event()
        mgr._persistent._worker.submit(release.wait, 30)
        mgr.save(1, {"x": torch.zeros(10)})
        threading.Timer(0.2, release.set).start()
        mgr.save(2, {"x": torch.ones(10)})  # waits for step 1, then stages step 2
        mgr.wait()
        assert [c.step for c in mgr.committed()] == [1, 2]


class Broken:
    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError("cannot snapshot")

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        pass


def test_staging_failure_raises_and_leaves_nothing_visible(tmp_path: Path) -> None:
    with CheckpointManager(str(tmp_path), persistent_every=1) as mgr:
        mgr.save(1, {"x": torch.zeros(3)})
        mgr.wait()
        with pytest.raises(CheckpointError, match="cannot snapshot"):
            mgr.save(2, {"x": torch.zeros(3), "b": Broken()})
        with pytest.raises(CheckpointError, match="rank"):
            mgr.wait()
        assert [c.step for c in mgr.committed()] == [1]


def test_every_save_loads_with_dcp_when_the_layout_changes_between_saves(tmp_path: Path) -> None:
    # Plans are reused while the layout is unchanged: a change (new key, new shape, new dtype,
    # a scalar turned into a tensor) must be planned afresh, and an unchanged save after it too.
    states = [
        {"w": torch.rand(4, 4), "step": 1},
        {"w": torch.rand(4, 4), "step": 2},
        {"w": torch.rand(4, 4), "b": torch.rand(3), "step": 3},
        {"w": torch.rand(8, 2), "b": torch.rand(3), "step": 4},
        {"w": torch.rand(8, 2).double(), "b": torch.rand(3), "step": 5},
        {"w": torch.rand(8, 2).double(), "b": torch.rand(3), "step": torch.tensor(6)},
        {"w": torch.rand(8, 2).double(), "b": torch.rand(3), "step": torch.tensor(7)},
    ]
    with CheckpointManager(str(tmp_path), persistent_every=1, keep=len(states)) as mgr:
        paths = []
        for i, state in enumerate(states, start=1):
            mgr.save(i, state)
            mgr.wait()
            paths.append(mgr.committed()[-1].path)
    for state, path in zip(states, paths, strict=True):
        target = {k: torch.zeros_like(v) if torch.is_tensor(v) else 0 for k, v in state.items()}
        dcp.load(target, checkpoint_id=path)
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                torch.testing.assert_close(target[k], v)
            else:
                assert target[k] == v


def test_every_save_holds_its_own_values_when_archives_are_reused(tmp_path: Path) -> None:
    # A value exactly equal to the last save's reuses its archive (object_bytes): each save must
    # still load back its own values and types, including the ones == cannot tell apart.
    values: list[Any] = [0.1, 0.1, 0.05, -0.0, 0.0, float("nan"), True, 1, (1, 2), [1, 2], [1, 3]]
    with CheckpointManager(str(tmp_path), persistent_every=1, keep=len(values)) as mgr:
        paths = []
        for i, v in enumerate(values, start=1):
            mgr.save(i, {"w": torch.zeros(2), "v": v, "names": ["a", "b"] if i % 2 else ["a"]})
            mgr.wait()
            paths.append(mgr.committed()[-1].path)
    for i, (v, path) in enumerate(zip(values, paths, strict=True), start=1):
        target: dict[str, Any] = {"w": torch.ones(2), "v": None, "names": None}
        dcp.load(target, checkpoint_id=path)
        assert type(target["v"]) is type(v) and repr(target["v"]) == repr(v), (i, target["v"])
        assert target["names"] == (["a", "b"] if i % 2 else ["a"])


@pytest.mark.parametrize("tier", ["persistent", "memory"])
def test_a_fresh_optimizer_gets_its_saved_state(tmp_path: Path, tier: str) -> None:
    # A restart builds its optimizer anew: it has no state until its first step, and the load
    # must still restore the saved moments and step count.
    model, opt = _trained(0)
    kw: dict[str, Any] = (
        {"persistent_every": 1}
        if tier == "persistent"
        else {"persistent_every": 100, "local_every": 1}
    )
    with CheckpointManager(str(tmp_path), **kw) as mgr:
        mgr.save(1, {"model": model, "optim": opt})
        mgr.wait()
        torch.manual_seed(1)
        model2 = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)
        )
        opt2 = torch.optim.AdamW(model2.parameters(), lr=0.1)
        assert not opt2.state
        assert mgr.load_latest({"model": model2, "optim": opt2}) == 1
        assert mgr.last_restore is not None and mgr.last_restore.tier == tier
    want, got = opt.state_dict(), opt2.state_dict()
    assert got["param_groups"][0]["lr"] == want["param_groups"][0]["lr"]
    assert want["state"].keys() == got["state"].keys()
    for i, s in want["state"].items():
        for name, value in s.items():
            assert torch.equal(got["state"][i][name], value), (i, name)
    assert all(p.grad is None for p in model2.parameters())


def test_a_fresh_optimizer_stays_fresh_when_there_is_nothing_to_load(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    with CheckpointManager(str(tmp_path), persistent_every=1, local_every=1) as mgr:
        assert mgr.load_latest({"model": model, "optim": opt}) is None
    assert not opt.state
    assert opt.param_groups[0]["lr"] == 0.1
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert all(p.grad is None for p in model.parameters())
