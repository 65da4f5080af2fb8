"""RerunStateMachine in one process: verdicts, replay, checks, state_dict, in-job exits."""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from restartable.rerun import (
    Diagnostic,
    InvalidTransition,
    RerunConfigError,
    RerunDataIterator,
    RerunErrorInjector,
    RerunExit,
    RerunStateMachine,
    State,
    iterations_to_skip,
)


def batches(n: int = 1000, nan_at: int | None = None, spike_at: int | None = None) -> Any:
    for i in range(n):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(4, 8, generator=g)
        if i == nan_at:
            x[0, 0] = math.nan
        if i == spike_at:
            x = x * 1e4
        yield x


class Loop:
    """A tiny training loop whose step draws from every RNG the machine must replay."""

    def __init__(
        self, rsm: RerunStateMachine, data: Any = None, extra_check: Any = None, lr: float = 0.01
    ) -> None:
        torch.manual_seed(0)
        self.rsm = rsm
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=lr)
        self.data = RerunDataIterator(data if data is not None else batches())
        self.passes: list[tuple[int, float, Any]] = []  # (iteration, loss, microbatch)
        self.extra_check = extra_check

    def step(self) -> tuple[bool, bool, int]:
        while self.rsm.should_run_forward_backward(self.data):
            self.opt.zero_grad()
            x = next(self.data)
            noise = np.random.rand() + random.random()
            loss = self.model(x).pow(2).mean() + noise
            loss.backward()
            self.rsm.validate_loss(loss)
            if self.extra_check is not None:
                self.extra_check(self.rsm, loss)
            self.passes.append((self.rsm.iteration, loss.item(), x))
        decision = self.rsm.should_checkpoint_and_exit()
        if not decision[1]:
            self.opt.step()
        return decision

    def run(self, steps: int) -> tuple[bool, bool, int]:
        decision = (False, False, 0)
        for _ in range(steps):
            decision = self.step()
            if decision[1]:
                break
        return decision


def machine(kind: str | None = None, at: int = 3, **kw: Any) -> RerunStateMachine:
    inj = RerunErrorInjector(kind, at=[(0, at)]) if kind else None
    kw.setdefault("hardware_id", "host-a")
    return RerunStateMachine("validate_results", error_injector=inj, **kw)


def test_no_fault_runs_each_step_once() -> None:
    loop = Loop(machine())
    assert loop.run(5) == (False, False, 0)
    assert [p[0] for p in loop.passes] == [1, 2, 3, 4, 5]


def test_rejected_real_result_is_replayed_bit_identically() -> None:
    # Rejecting a real (finite) loss: the re-run must give the same value with tolerance 0,
    # which holds only if the RNGs (torch dropout, NumPy, Python) and the microbatch replay.
    def reject_step_2(rsm: RerunStateMachine, loss: torch.Tensor) -> None:
        rsm.validate_result(loss, lambda v: rsm.iteration == 2, "forced", fatal=True)

    loop = Loop(machine(), extra_check=reject_step_2)
    assert loop.run(5) == (True, True, 16)
    (it1, loss1, x1), (it2, loss2, x2) = loop.passes[1], loop.passes[2]
    assert it1 == it2 == 2
    assert loss1 == loss2
    assert torch.equal(x1, x2)


def test_transient_error_exits_17_without_checkpoint() -> None:
    loop = Loop(machine("transient_error"))
    assert loop.run(5) == (False, True, 17)
    assert loop.rsm.verdict is Diagnostic.TRANSIENT_ERROR
    assert [p[0] for p in loop.passes] == [1, 2, 3, 3]


def pending_checkpoint(kind: str) -> dict[str, Any]:
    loop = Loop(machine(kind))
    assert loop.run(5) == (True, True, 16)
    assert loop.rsm.state is State.WILL_RERUN_ELSEWHERE
    return loop.rsm.state_dict()


@pytest.mark.parametrize(
    ("kind", "verdict"),
    [
        ("persistent_error", Diagnostic.PERSISTENT_ERROR),
        ("correct_result", Diagnostic.CORRECT_RESULT),
    ],
)
def test_reproducible_error_is_settled_on_other_hardware(kind: str, verdict: Diagnostic) -> None:
    sd = pending_checkpoint(kind)
    rsm = machine(kind, hardware_id="host-b")
    rsm.load_state_dict(sd)
    loop = Loop(rsm)
    assert loop.step() == (False, True, 17)
    assert rsm.verdict is verdict
    assert [p[0] for p in loop.passes] == [3]  # the saved step ran again, once


def test_resumed_on_the_suspect_hardware_exits_16_without_checkpoint() -> None:
    sd = pending_checkpoint("persistent_error")
    rsm = machine("persistent_error", hardware_id="host-a")
    rsm.load_state_dict(sd)
    assert Loop(rsm).step() == (False, True, 16)
    assert rsm.state_dict()["state"] == "will_rerun_elsewhere"  # still resumable from disk


def test_state_dict_has_a_constant_structure() -> None:
    idle = machine().state_dict()
    pending = pending_checkpoint("persistent_error")
    assert idle.keys() == pending.keys()
    assert {k: type(v) for k, v in idle.items()} == {k: type(v) for k, v in pending.items()}
    assert idle["rng"] == b"" and pending["rng"] != b""


def test_state_dict_round_trip() -> None:
    loop = Loop(machine(check_for_spiky_loss=True, spiky_loss_warmup=2))
    loop.run(4)
    sd = loop.rsm.state_dict()
    other = machine(check_for_spiky_loss=True, spiky_loss_warmup=2)
    other.load_state_dict(sd)
    assert other.state_dict() == sd
    assert other.iteration == 4


def test_pending_rerun_is_dropped_when_the_mode_no_longer_validates() -> None:
    sd = pending_checkpoint("persistent_error")
    rsm = RerunStateMachine("disabled")
    rsm.load_state_dict(sd)
    assert rsm.state is State.IDLE and rsm.iteration == 3


def test_spiky_loss_after_warmup_reruns_and_continues() -> None:
    warmup = 5
    loop = Loop(
        machine(check_for_spiky_loss=True, spiky_loss_warmup=warmup),
        data=batches(spike_at=warmup + 2),  # iteration warmup + 3 sees the spike
        lr=0.0,  # keep the spike from diverging the model: only one step is spiky
    )
    assert loop.run(warmup + 5) == (False, False, 0)
    iterations = [p[0] for p in loop.passes]
    assert iterations.count(warmup + 3) == 2  # rejected, re-run in place, continued
    assert len(iterations) == warmup + 6


def test_spike_during_warmup_is_not_flagged() -> None:
    loop = Loop(machine(check_for_spiky_loss=True, spiky_loss_warmup=5), data=batches(spike_at=2))
    loop.run(6)
    assert [p[0] for p in loop.passes] == [1, 2, 3, 4, 5, 6]


def test_data_nan_is_a_correct_result_and_listed_for_skipping(tmp_path: Path) -> None:
    track = str(tmp_path / "rejected.jsonl")
    loop = Loop(machine(result_rejected_tracker_filename=track), data=batches(nan_at=1))
    assert loop.run(5) == (True, True, 16)
    rsm = machine(result_rejected_tracker_filename=track, hardware_id="host-b")
    rsm.load_state_dict(loop.rsm.state_dict())
    assert Loop(rsm).step() == (False, True, 17)
    assert rsm.verdict is Diagnostic.CORRECT_RESULT
    assert iterations_to_skip(track) == [2]


def test_transient_error_is_not_listed_for_skipping(tmp_path: Path) -> None:
    track = str(tmp_path / "rejected.jsonl")
    Loop(machine("transient_error", result_rejected_tracker_filename=track)).run(5)
    assert iterations_to_skip(track) == []


def test_checks_of_a_step_make_no_host_sync_until_one_read(monkeypatch: pytest.MonkeyPatch) -> None:
    rsm = machine(check_for_spiky_loss=True, spiky_loss_warmup=1)
    loop = Loop(rsm)
    loop.run(2)  # past warm-up
    calls: dict[str, int] = {"item": 0, "bool": 0, "tolist": 0}
    for name, attr in (("item", "item"), ("bool", "__bool__"), ("tolist", "tolist")):
        orig = getattr(torch.Tensor, attr)

        def counted(
            self: torch.Tensor, *a: Any, _o: Callable[..., Any] = orig, _n: str = name
        ) -> Any:
            calls[_n] += 1
            return _o(self, *a)

        monkeypatch.setattr(torch.Tensor, attr, counted)
    x = torch.randn(4, 8)
    data = RerunDataIterator(iter([x]))
    assert rsm.should_run_forward_backward(data)
    loss = loop.model(next(data)).pow(2).mean()
    # Tensor checks (as on a GPU, where each read would be a device sync).
    rsm.validate_result(loss, torch.isnan, "nan")
    rsm.validate_result(
        loss, lambda v: rsm.is_unexpectedly_large(v, 10.0, "loss", num_samples=1), "big"
    )
    assert calls == {"item": 0, "bool": 0, "tolist": 0}
    assert not rsm.should_run_forward_backward(data)
    assert calls == {"item": 0, "bool": 0, "tolist": 1}


def test_determinism_stats_deterministic_step() -> None:
    loop = Loop(RerunStateMachine("report_determinism_stats"))
    assert loop.run(4) == (False, False, 0)
    st = loop.rsm.determinism_stats()["loss is NaN or Inf"]
    assert st["count"] == 4 and st["identical"] == 4 and st["max"] == 0.0
    assert [p[0] for p in loop.passes] == [1, 1, 2, 2, 3, 3, 4, 4]


def test_determinism_stats_noisy_step() -> None:
    noise = random.SystemRandom()  # outside every RNG the machine restores

    def noisy(rsm: RerunStateMachine, loss: torch.Tensor) -> None:
        rsm.validate_result(loss + noise.random(), lambda v: False, "noisy")

    loop = Loop(RerunStateMachine("report_determinism_stats"), extra_check=noisy)
    loop.run(5)
    st = loop.rsm.determinism_stats()["noisy"]
    assert st["count"] == 5 and st["identical"] == 0
    assert 0 < st["p50"] <= st["p90"] <= st["p99"] <= st["max"]
    assert st["avg"] > 0


def test_disabled_mode_runs_once_and_checks_nothing() -> None:
    loop = Loop(RerunStateMachine("disabled"), data=batches(nan_at=0))
    assert loop.run(3) == (False, False, 0)
    assert [p[0] for p in loop.passes] == [1, 2, 3]


# -- exits ------------------------------------------------------------------------------


def test_standalone_exit_is_sys_exit_with_the_code() -> None:
    loop = Loop(machine("persistent_error"))
    loop.run(5)
    with pytest.raises(SystemExit) as ei:
        loop.rsm.exit_or_raise()
    assert ei.value.code == 16


def test_standalone_exit_closes_the_manager_first_bounded(caplog: pytest.LogCaptureFixture) -> None:
    """The checkpoint-then-exit save was lost: the exit skipped the manager's close()."""
    closed: list[str] = []

    class Manager:
        def close(self) -> None:
            closed.append("saved")

    class Hung:
        def close(self) -> None:
            threading.Event().wait(30)  # a hung storage: the exit goes on after close_timeout

    loop = Loop(machine("persistent_error"))
    loop.run(5)
    t0 = time.monotonic()
    with pytest.raises(SystemExit) as ei:
        loop.rsm.exit_or_raise(close=[Manager(), Hung()], close_timeout=0.2)
    assert ei.value.code == 16 and closed == ["saved"]
    assert time.monotonic() - t0 < 5
    assert any("did not close within" in r.getMessage() for r in caplog.records)


def test_in_job_exit_demotes_the_suspect_rank() -> None:
    loop = Loop(machine("persistent_error", in_job=True))
    loop.run(5)
    with pytest.raises(RerunExit) as ei:
        loop.rsm.exit_or_raise()
    e = ei.value
    assert e.exit_code == 16 and e.restartable_rank_action == "demote"
    assert e.suspect_ranks == (0,) and e.suspect_hardware == ("host-a",)


def test_in_job_transient_error_restarts_without_action() -> None:
    loop = Loop(machine("transient_error", in_job=True))
    loop.run(5)
    with pytest.raises(RerunExit) as ei:
        loop.rsm.exit_or_raise()
    assert ei.value.exit_code == 17 and ei.value.restartable_rank_action is None
    assert ei.value.verdict == "transient_error"


def test_in_job_correct_result_leaves_the_job() -> None:
    sd = pending_checkpoint("correct_result")
    rsm = machine("correct_result", hardware_id="host-b", in_job=True)
    rsm.load_state_dict(sd)
    assert Loop(rsm).step() == (False, True, 17)
    with pytest.raises(SystemExit) as ei:  # a restart cannot fix the model or the data
        rsm.exit_or_raise()
    assert ei.value.code == 17


def test_exit_or_raise_without_an_exit_decision_is_misuse() -> None:
    with pytest.raises(InvalidTransition, match="exit=True"):
        machine().exit_or_raise()


def test_in_job_persistent_fault_continues_and_retires_the_hardware_later() -> None:
    sd = pending_checkpoint("persistent_error")
    rsm = machine("persistent_error", hardware_id="host-b", in_job=True)
    rsm.load_state_dict(sd)
    loop = Loop(rsm)
    assert loop.step() == (False, False, 0)  # the work already runs on healthy hardware
    assert rsm.verdict is Diagnostic.PERSISTENT_ERROR
    assert rsm.faulty_hardware == ["host-a"]
    back_on_a = machine(hardware_id="host-a", in_job=True)
    back_on_a.load_state_dict(rsm.state_dict())
    with pytest.raises(RerunExit) as ei:
        back_on_a.should_run_forward_backward(None)
    assert ei.value.restartable_rank_action == "retire"


# -- bad input --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mode": "validate"}, r"mode \('validate'\) must be one of"),
        ({"spiky_loss_factor": 1.0}, r"spiky_loss_factor \(1.0\) must be a number greater than 1"),
        ({"spiky_loss_factor": -3}, "spiky_loss_factor"),
        ({"spiky_loss_warmup": 0}, "spiky_loss_warmup"),
        ({"result_rejected_tracker_filename": "/nonexistent/dir/t.jsonl"}, "writable"),
    ],
)
def test_bad_input_fails_at_construction(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(RerunConfigError, match=match):
        RerunStateMachine(**kwargs)


def test_bad_injector_kind() -> None:
    with pytest.raises(RerunConfigError, match="kind"):
        RerunErrorInjector("sometimes")


def test_plain_iterator_is_rejected_when_validating() -> None:
    with pytest.raises(RerunConfigError, match="RerunDataIterator"):
        machine().should_run_forward_backward(iter([1, 2]))  # type: ignore[arg-type]


def test_non_scalar_value_is_rejected() -> None:
    rsm = machine()
    assert rsm.should_run_forward_backward(None)
    with pytest.raises(RerunConfigError, match="one-element tensor"):
        rsm.validate_result(torch.ones(3), lambda v: False, "vec")


def test_foreign_state_dict_is_rejected() -> None:
    with pytest.raises(RerunConfigError, match="missing 'version'"):
        machine().load_state_dict({"model": 1})
