"""The sdc fault kinds and in-place scrubbing on one process (real model, real backward passes):
a flipped mantissa bit is found when it is transient, and, as documented, not when the device
repeats it (in place only catches transient faults)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from restartable.inprocess import faults
from restartable.inprocess.faults.sdc import GradientBitFlip, flip_bit_
from restartable.rerun.scrub import Scrubber
from restartable.rerun.scrub_finding import SilentDataCorruption
from restartable.rerun.sdc_digest import Captured, digest, module_grads, params_of, recompute

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from gpt import GPTConfig, batch, build_model, corpus

CFG = GPTConfig()


def _forward(m: torch.nn.Module, xy: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return m(*xy)


def _xy(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return batch(corpus(), seed=1, step=step, rank=0, batch_size=2, seq=CFG.seq)


def test_plan_accepts_both_sdc_kinds() -> None:
    plan = faults.parse_plan("sdc@rank1:step40,sdc-once@rank0:step7", steps=50, world_size=2)
    assert [f.name for f in plan] == ["sdc@rank1:step40", "sdc-once@rank0:step7"]
    assert faults.KINDS["sdc"].lasting and faults.KINDS["sdc-once"].numeric
    assert not any(f.loses_rank for f in plan)


def test_flip_changes_exactly_one_mantissa_bit_of_the_largest_element() -> None:
    g = torch.tensor([0.5, -3.0, 1.25])
    before = g.clone()
    assert flip_bit_(g) == 1
    diff = (g.view(torch.int32) ^ before.view(torch.int32)).tolist()
    assert diff == [0, 1 << 22, 0]
    assert torch.isfinite(g).all() and g[1] != before[1]


def test_once_corrupts_one_backward_lasting_every_one() -> None:
    model = build_model(CFG, 1)
    flip = GradientBitFlip()
    flip.attach(model)
    xy = _xy(0)

    def run() -> str:
        model.zero_grad(set_to_none=True)
        loss = _forward(model, xy)
        loss.backward()
        return digest(module_grads(model), loss)

    clean = run()
    flip.arm_once()
    assert run() != clean
    assert run() == clean and flip.flips == 1
    flip.arm_lasting()
    assert run() == run() != clean and flip.flips == 3


def test_recompute_is_bitwise_and_puts_the_module_back() -> None:
    model = build_model(CFG, 1)
    xy = _xy(3)
    cap = Captured(model)
    loss = _forward(model, xy)
    loss.backward()
    cap.close()
    first = digest(cap.grads, loss)
    params, grads = params_of(model), {n: p.grad.clone() for n, p in model.named_parameters()}
    rng = torch.get_rng_state()
    assert recompute(model, _forward, xy, rng) == first
    with torch.no_grad():  # from other parameters, then back
        other = {n: p + 1 for n, p in params.items()}
    assert recompute(model, _forward, xy, rng, other) != first
    for n, p in model.named_parameters():
        assert torch.equal(p, params[n]) and torch.equal(p.grad, grads[n])


def _train(scrub: Scrubber, flip: GradientBitFlip, model: torch.nn.Module, steps: range) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in steps:
        xy = _xy(step)
        scrub.before_step(step, xy, snapshot=lambda: None)
        opt.zero_grad(set_to_none=True)
        loss = _forward(model, xy)
        loss.backward()
        scrub.after_step(loss)
        opt.step()


def test_in_place_finds_a_transient_flip_at_a_sampled_step() -> None:
    model = build_model(CFG, 1)
    flip = GradientBitFlip()
    flip.attach(model)  # before the scrubber's capture: the capture sees the corruption
    scrub = Scrubber(every=2, mode="in_place", compute=_forward)
    scrub.begin(model, rank=0, world=1, initial_rank=0)
    _train(scrub, flip, model, range(1, 4))  # checks at step 2: clean, determinism verified
    flip.arm_once()
    with pytest.raises(SilentDataCorruption) as err:
        _train(scrub, flip, model, range(4, 5))
    f = err.value.finding
    assert (f.rank, f.step, f.verdict, f.rollback_to) == (0, 4, "transient", 4)
    assert err.value.restartable_rank_action is None  # a transient: the rank stays
    assert "transient" in str(err.value) and "step 4" in str(err.value)


def test_in_place_cannot_see_a_fault_the_device_repeats() -> None:
    model = build_model(CFG, 1)
    flip = GradientBitFlip()
    flip.attach(model)
    flip.arm_lasting()  # a faulty chip: the re-computation is corrupted the same way
    scrub = Scrubber(every=1, mode="in_place", compute=_forward)
    scrub.begin(model, rank=0, world=1, initial_rank=0)
    _train(scrub, flip, model, range(1, 6))
    assert scrub.findings == [] and flip.flips > 5


def test_bad_settings_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"every \(0\) must be >= 1"):
        Scrubber(every=0, mode="in_place", compute=_forward)
    with pytest.raises(ValueError, match="mode 'reserve' needs make_model and make_store"):
        Scrubber(every=5, mode="reserve", compute=_forward)


def test_attribution_names_the_sdc_finding() -> None:
    from restartable.inprocess.report import attribution

    base = {"launch": "L", "iteration": 0, "host": "node7"}
    records = [
        {
            **base,
            "t": 1.0,
            "event": "sdc_finding",
            "rank": 1,
            "fault_rank": 1,
            "training_rank": 1,
            "step": 40,
            "verdict": "persistent",
            "detected_at": 45,
            "rollback_to": 25,
            "steps_rolled_back": 20,
            "settled_by": "rank 1's re-run gave its own again result",
        },
        {
            **base,
            "t": 1.1,
            "event": "fault",
            "rank": 1,
            "kind": "exception",
            "exc_type": "restartable.rerun.scrub_finding.SilentDataCorruption",
            "where": "x.py:1",
            "step": 45,
        },
        {**base, "t": 0.5, "event": "job_start", "rank": 0, "host": "node8"},
    ]
    (finding,) = attribution.analyse(records)
    assert (finding.fault_class, finding.origin, finding.fault.rank) == ("sdc", "hardware", 1)
    assert finding.fault.host == "node7" and finding.fault.step == 40
    line = finding.line()
    assert "persistent at step 40" in line and "rolled back 20 step(s) to step 25" in line, line
    assert "settled by rank 1's re-run" in finding.as_dict()["sdc"]
