"""The overlapped GPU snapshot's decisions, on the CPU: what waits on what, what is published,
what is dropped (checkpoint/local/overlap.py; the CUDA calls are behind ``DeviceOps``).

``FakeOps`` stands for the streams: its copy runs at once, so the data are right by
construction; what the tests check is the order the tier gives the device (the copy after the
optimizer step it snapshots, the next write after the copy's end event), and the tier's
decisions (published only when guarded, dropped when a write raced the copy).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from restartable.checkpoint._torch_private import version_counter
from restartable.checkpoint.local import LocalTier
from tests.no_group import NoGroup


class FakeEvent:
    def __init__(self, name: str) -> None:
        self.name = name
        self.done = True


class FakeOps:
    """Streams that run at once, with a log of the calls in order."""

    def __init__(self, *, copy_ms: float = 1.0, hidden_ms: float = 5.0) -> None:
        self.log: list[tuple[str, Any]] = []
        self.copy_ms = copy_ms
        self.hidden_ms = hidden_ms
        self.watched: torch.Tensor | None = None  # its version when the training stream waits
        self.version_at_wait: list[int] = []

    def new_stream(self) -> str:
        return "side"

    def wait_for_current(self, stream: Any) -> None:
        self.log.append(("side waits for training", stream))

    @contextmanager
    def on(self, stream: Any) -> Iterator[None]:
        self.log.append(("on", stream))
        yield

    def record(self, stream: Any | None = None) -> FakeEvent:
        event = FakeEvent(f"{stream or 'training'}#{len(self.log)}")
        self.log.append(("record", event))
        return event

    def done(self, event: Any) -> bool:
        return bool(event.done)

    def synchronize(self, event: Any) -> None:
        self.log.append(("synchronize", event))

    def current_waits(self, event: Any) -> None:
        self.log.append(("training waits", event))
        if self.watched is not None:
            self.version_at_wait.append(version_counter(self.watched))

    def elapsed_ms(self, start: Any, end: Any) -> float:
        # (copy start, copy end) are the side stream's; (returned, written) the training's.
        return self.copy_ms if start.name.startswith("side") else self.hidden_ms

    def calls(self, name: str) -> list[Any]:
        return [arg for what, arg in self.log if what == name]


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(4, 8, generator=g)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _tier(ops: FakeOps, local_dir: Path | None = None) -> LocalTier:
    return LocalTier(
        local_dir=local_dir,
        replication_factor=1,
        algo="atomic",
        keep=2,
        group=NoGroup(),
        overlap=True,
        device_ops=ops,
    )


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}


def _equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    fa = {k: v for k, v in a["model"].items()}
    fb = {k: v for k, v in b["model"].items()}
    return fa.keys() == fb.keys() and all(torch.equal(fa[k], fb[k]) for k in fa)


def test_saves_every_step_restore_bit_equal_and_the_next_step_waits_for_the_copy() -> None:
    model, opt = _model()
    _train_step(model, opt, 0)  # the momentum buffers exist from here on
    ops = FakeOps()
    ops.watched = model[0].weight
    with _tier(ops) as tier:
        for step in range(1, 8):
            state = _state(model, opt, step)
            want = copy.deepcopy(state)
            version_at_save = version_counter(model[0].weight)
            tier.save(step, state)
            # Queued in order: the side stream waits for the optimizer step just taken, then
            # the copy's events; nothing is held until a writer guarded it.
            assert [w for w, _ in ops.log[-5:]] == [
                "side waits for training",
                "record",
                "on",
                "record",
                "record",
            ]
            assert (step, 0) not in tier._held
            _train_step(model, opt, step)  # its optimizer step is the guard
            assert ops.version_at_wait[-1] == version_at_save  # no write before the wait
            tier.wait()
            probe = copy.deepcopy(state)
            res = tier.load(probe, min_step=step)
            assert res is not None and res.step == step and res.tier == "memory"
            assert _equal(probe, want)
            # Published once its copy ended: the tier's thread waited on the copy's end event.
            assert ops.calls("synchronize")[-1] is ops.calls("training waits")[-1]


def test_a_write_before_the_optimizer_step_drops_the_snapshot_and_turns_overlap_off(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model, opt = _model()
    _train_step(model, opt, 0)
    ops = FakeOps()
    with _tier(ops) as tier:
        tier.save(1, _state(model, opt, 1))
        _train_step(model, opt, 1)
        tier.save(2, _state(model, opt, 2))
        with caplog.at_level(logging.WARNING, logger="restartable.checkpoint.local.overlap"):
            with torch.no_grad():
                model[2].bias.add_(1.0)  # a raced write: not through before_write()
            _train_step(model, opt, 2)
        assert "'model/2.bias' was written in place after save() returned" in caplog.text
        assert "before_write()" in caplog.text
        probe = copy.deepcopy(_state(model, opt, 0))
        res = tier.load(probe, min_step=None)
        assert res is not None and res.step == 1  # step 2 was never published
        # From now on synchronous, and exact.
        queued = len(ops.log)
        state = _state(model, opt, 3)
        want = copy.deepcopy(state)
        tier.save(3, state)
        _train_step(model, opt, 3)
        assert len(ops.log) == queued
        res = tier.load(probe, min_step=3)
        assert res is not None and res.step == 3 and _equal(probe, want)


def test_before_write_lets_a_users_write_keep_the_overlap() -> None:
    model, opt = _model()
    _train_step(model, opt, 0)
    ops = FakeOps()
    with _tier(ops) as tier:
        state = _state(model, opt, 1)
        want = copy.deepcopy(state)
        tier.save(1, state)
        tier.before_write()
        with torch.no_grad():
            model[2].bias.add_(1.0)
        tier.save(2, _state(model, opt, 2))  # still overlapped: queued on the side stream
        assert ops.calls("on")[-1] == "side" and len(ops.calls("on")) == 2
        probe = copy.deepcopy(state)
        res = tier.load(probe, min_step=1)
        assert res is not None and res.step == 2
        assert not torch.equal(probe["model"]["2.bias"], want["model"]["2.bias"])
        assert torch.equal(probe["model"]["2.bias"], model[2].bias.detach())


def test_an_exception_between_the_copy_and_its_event_still_restores_that_step() -> None:
    """In-process restart: train() unwound after save() returned; the load settles the pending
    snapshot (no write raced it) and restores it."""
    model, opt = _model()
    _train_step(model, opt, 0)
    ops = FakeOps()
    with _tier(ops) as tier:
        state = _state(model, opt, 5)
        want = copy.deepcopy(state)
        tier.save(5, state)
        probe = copy.deepcopy(state)
        for t in probe["model"].values():
            t.zero_()
        res = tier.load(probe, min_step=None)
        assert res is not None and res.step == 5 and _equal(probe, want)


def test_a_process_killed_between_the_copy_and_its_event_leaves_the_step_before(
    tmp_path: Path,
) -> None:
    """The node-local file of a snapshot is written only once it is published: a replacement
    process finds the step before, whole."""
    model, opt = _model()
    _train_step(model, opt, 0)
    ops = FakeOps()
    local = tmp_path / "local"
    local.mkdir(mode=0o700)
    dead = _tier(ops, local)
    first = _state(model, opt, 1)
    want = copy.deepcopy(first)
    dead.save(1, first)
    _train_step(model, opt, 1)
    dead.save(2, _state(model, opt, 2))  # pending: the process "dies" before any guard
    # What dies with the process: its thread (the step-1 write is over) and its step hook.
    dead._worker.stop(timeout=5.0)
    assert dead._step_hook is not None
    dead._step_hook.remove()
    with LocalTier(
        local_dir=local, replication_factor=1, algo="atomic", keep=2, group=NoGroup()
    ) as fresh:
        probe = copy.deepcopy(first)
        for t in probe["model"].values():
            t.zero_()
        res = fresh.load(probe, min_step=None)
    assert res is not None and res.step == 1 and res.tier != "memory"
    assert _equal(probe, want)


def test_a_copy_longer_than_what_it_hides_behind_is_said_once_with_the_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model, opt = _model()
    _train_step(model, opt, 0)
    ops = FakeOps(copy_ms=31.0, hidden_ms=10.0)
    with (
        caplog.at_level(logging.WARNING, logger="restartable.checkpoint.local.overlap"),
        _tier(ops) as tier,
    ):
        for step in range(1, 5):
            tier.save(step, _state(model, opt, step))
            _train_step(model, opt, step)
    said = [r.getMessage() for r in caplog.records if "longer than" in r.getMessage()]
    assert len(said) == 1
    assert "took 31.0 ms" in said[0] and "10.0 ms of forward and backward" in said[0]
    assert "saving every 4 steps (local_every=4)" in said[0]
