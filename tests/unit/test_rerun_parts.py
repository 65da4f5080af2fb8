"""The parts of rerun on their own: data replay, RNG snapshot, checks, stats, injector, tracker,
loss checks, hardware ledger."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from restartable.rerun import (
    RerunDataIterator,
    RerunErrorInjector,
    compare_floats,
    iterations_to_skip,
    rng,
)
from restartable.rerun.checks import LargeValueTracker
from restartable.rerun.errors import RerunConfigError, RerunExit
from restartable.rerun.hardware import HardwareLedger
from restartable.rerun.loss_checks import NAN_LOSS_MESSAGE, SPIKY_LOSS_MESSAGE, LossChecks
from restartable.rerun.record import Rejected, StepRecord
from restartable.rerun.state_machine import Diagnostic, State, Transition
from restartable.rerun.stats import QuickStats
from restartable.rerun.tracker import ResultTracker


def test_data_iterator_replays_the_step_then_reads_on() -> None:
    it = RerunDataIterator(range(10))
    it.advance(record=True)
    assert [next(it), next(it)] == [0, 1]
    it.rewind()
    assert [next(it), next(it), next(it)] == [0, 1, 2]  # a re-run may read further
    it.advance(record=False)
    assert next(it) == 3 and it.replay_buffer() == []


def test_data_iterator_replays_a_loaded_buffer_first() -> None:
    it = RerunDataIterator(iter([7, 8]))
    it.load_replay_buffer(["a", "b"])
    assert list(it) == ["a", "b", 7, 8]


def test_rng_snapshot_restores_every_generator_through_bytes() -> None:
    snap = rng.RngSnapshot.from_bytes(rng.capture().to_bytes())
    first = (random.random(), np.random.rand(), torch.rand(1).item())
    rng.restore(snap)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == first


def test_rng_snapshot_carries_user_state() -> None:
    box = {"v": 1}
    snap = rng.capture(lambda: box["v"])
    box["v"] = 2
    rng.restore(snap, lambda v: box.update(v=v))
    assert box["v"] == 1


@pytest.mark.parametrize(
    ("a", "b", "diff"),
    [(1.0, 1.0, 0.0), (math.nan, math.nan, 0.0), (1.0, math.nan, math.inf), (1.0, 3.0, 1.0),
     (-1.0, -3.0, 1.0), (math.inf, math.inf, 0.0), (math.inf, 1.0, math.inf)],
)  # fmt: skip
def test_compare_floats(a: float, b: float, diff: float) -> None:
    assert compare_floats(a, b) == diff


@pytest.mark.parametrize("as_tensor", [False, True])
def test_large_values_after_warmup_ignore_nan_and_keep_the_max(as_tensor: bool) -> None:
    tr = LargeValueTracker()

    def check(v: float) -> bool:
        x = torch.tensor(v) if as_tensor else v
        return bool(tr.check(x, 10.0, "loss", num_samples=3))

    assert [check(v) for v in (1.0, 2.0, 500.0)] == [False, False, False]  # warm-up
    assert check(math.nan) is False
    assert check(4999.0) is False  # below 10 x 500
    assert check(1e6) is True
    assert check(49_000.0) is False  # the spike did not raise the max: 10 x 4999
    assert tr.state()["loss"] == [7.0, 49_000.0]


def test_quick_stats_summary() -> None:
    st = QuickStats()
    for d in (0.0, 0.0, 0.1, 0.2, 0.3):
        st.add(d)
    s = st.summary()
    assert (s["count"], s["identical"], s["max"]) == (5, 2, 0.3)
    assert s["p50"] == pytest.approx(0.1) and s["avg"] == pytest.approx(0.12)


def test_injector_rate_is_reproducible_and_roughly_one_in_n() -> None:
    def hits(seed: int) -> list[int]:
        inj = RerunErrorInjector("transient_error", rate=10, seed=seed)
        return [
            i for i in range(1, 1001)
            if inj.corrupts(State.INITIAL_RUN, rank=0, iteration=i, message="m", seq=0,
                            hardware_id="h")
        ]  # fmt: skip

    assert hits(1) == hits(1)
    assert 60 <= len(hits(1)) <= 140


def test_injector_persistent_follows_the_hardware() -> None:
    inj = RerunErrorInjector("persistent_error", at=[(0, 5)])
    kw = {"rank": 0, "iteration": 5, "message": "m", "seq": 0}
    assert inj.corrupts(State.INITIAL_RUN, hardware_id="A", **kw)  # type: ignore[arg-type]
    assert inj.corrupts(State.RERUN_IN_PLACE, hardware_id="A", **kw)  # type: ignore[arg-type]
    restored = RerunErrorInjector("persistent_error")
    restored.load(json.loads(json.dumps(inj.state())))
    assert not restored.corrupts(State.RERUN_ELSEWHERE, hardware_id="B", **kw)  # type: ignore[arg-type]


def _line(job: str, rank: int, it: int, status: str) -> str:
    return json.dumps({"job": job, "rank": rank, "iteration": it, "status": status}) + "\n"


def test_iterations_to_skip_needs_two_reproductions_on_one_rank(tmp_path: Path) -> None:
    f = tmp_path / "t.jsonl"
    f.write_text(
        _line("1", 0, 5, "initial_run")
        + _line("1", 0, 5, "first_rerun_reproducible")
        + _line("2", 0, 5, "second_rerun_reproducible")  # reproduced on other hardware: skip 5
        + _line("1", 1, 7, "first_rerun_reproducible")  # only once: not listed
        + _line("3", 0, 9, "first_rerun_reproducible")
        + _line("3", 1, 9, "first_rerun_reproducible")  # two ranks in one job: not the batch
        + _line("4", 0, 9, "first_rerun_reproducible")
        + _line("5", 0, 11, "first_rerun_not_reproducible")
        + _line("6", 0, 11, "second_rerun_not_reproducible")
        + '{"cut by a cra'
    )
    assert iterations_to_skip(f) == [5]
    assert iterations_to_skip(tmp_path / "missing.jsonl") == []


def test_tracker_writes_json_lines(tmp_path: Path) -> None:
    t = ResultTracker(tmp_path / "t.jsonl")
    t.record(rank=1, iteration=3, status="initial_run", result=math.nan, message="m",
             hardware_id="h")  # fmt: skip
    rec = json.loads((tmp_path / "t.jsonl").read_text())
    assert (rec["rank"], rec["iteration"], rec["result"], rec["hardware"]) == (1, 3, "nan", "h")


def _loss_checks(**kw: Any) -> LossChecks:
    opts: dict[str, Any] = {
        "check_for_nan_in_loss": True,
        "check_for_spiky_loss": True,
        "spiky_loss_factor": 10.0,
        "spiky_loss_warmup": 2,
        "large": LargeValueTracker(),
    }
    return LossChecks(**{**opts, **kw})


def test_loss_checks_run_nan_first_then_spiky_on_a_cpu_loss_read_once() -> None:
    calls: list[tuple[Any, str, bool, Any]] = []

    def validate_result(
        value: Any, rejection_func: Any, message: str, *, tolerance: float = 0.0, fatal: bool = True
    ) -> None:
        calls.append((value, message, fatal, rejection_func(value)))

    checks = _loss_checks()
    for loss in (1.0, 2.0, torch.tensor(30.0)):
        checks.validate(loss, validate_result)
    # A one-element CPU tensor arrives as a float; the third loss is >= 10 x the max of two.
    assert calls[-2:] == [
        (30.0, NAN_LOSS_MESSAGE, True, False),
        (30.0, SPIKY_LOSS_MESSAGE, False, True),
    ]
    assert [m for _v, m, _f, _r in calls[:4]] == [NAN_LOSS_MESSAGE, SPIKY_LOSS_MESSAGE] * 2
    calls.clear()
    _loss_checks(check_for_spiky_loss=False).validate(math.nan, validate_result)
    assert calls == [(calls[0][0], NAN_LOSS_MESSAGE, True, True)] and math.isnan(calls[0][0])


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"spiky_loss_factor": 1.0}, r"spiky_loss_factor \(1.0\) must be a number greater than 1"),
        ({"spiky_loss_warmup": 0}, r"spiky_loss_warmup \(0\) must be >= 1"),
    ],
)
def test_loss_checks_refuse_a_factor_or_warmup_that_flags_nothing(
    kw: dict[str, Any], match: str
) -> None:
    with pytest.raises(RerunConfigError, match=match):
        _loss_checks(**kw)


def test_hardware_ledger_retires_a_job_rank_on_hardware_a_persistent_fault_named() -> None:
    rec = StepRecord()
    rec.rejected = Rejected("loss", 0, True, 0.0, math.nan)
    rec.suspect_hw = "node1:cuda:0"
    persistent = Transition(State.IDLE, run=False, verdict=Diagnostic.PERSISTENT_ERROR)
    for retire, raises in ((False, False), (True, True)):
        ledger = HardwareLedger("node1:cuda:0")
        ledger.check(retire=retire, iteration=1)  # nothing known yet
        ledger.after(persistent, rec, iteration=3)
        ledger.after(persistent, rec, iteration=4)
        assert ledger.verdict is Diagnostic.PERSISTENT_ERROR
        assert ledger.suspects.hardware == ("node1:cuda:0",)
        assert ledger.faulty == ["node1:cuda:0"]  # named twice, listed once
        if not raises:
            ledger.check(retire=retire, iteration=5)  # standalone: the verdict ended the job
            continue
        with pytest.raises(RerunExit) as ei:
            ledger.check(retire=retire, iteration=5)
        assert ei.value.restartable_rank_action == "retire"
    transient = Transition(State.EXIT_FAILED, run=False, verdict=Diagnostic.TRANSIENT_ERROR)
    other = HardwareLedger("node2:cuda:0")
    other.after(transient, rec, iteration=1)
    other.check(retire=True, iteration=2)
    assert other.faulty == [] and other.verdict is Diagnostic.TRANSIENT_ERROR
