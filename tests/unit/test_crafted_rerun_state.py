"""A re-run machine's checkpointed state is input: any field that does not hold what
``RerunStateMachine.state_dict()`` writes is refused at ``load_state_dict`` with one error
naming it, never a ``ValueError``/``TypeError`` from deep inside (or a later step)."""

from __future__ import annotations

import io
import random
from typing import Any

import numpy as np
import pytest
import torch

from restartable.rerun import RerunStateMachine
from restartable.rerun.errors import RerunConfigError
from restartable.rerun.rng import capture

_WRONG: list[Any] = ["x", None, [], -1, 1e308, True, b"\x00junk", "[1,", '{"a": "b"}', '"s"']


def _saved(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _state() -> dict[str, Any]:
    return RerunStateMachine(mode="validate_results").state_dict()


def _wrong_values() -> list[tuple[str, Any]]:
    out = []
    for field, good in _state().items():
        for value in _WRONG:
            if value is None and field in ("rng", "data"):
                continue  # decode tests these for emptiness first: None is "nothing pending"
            number = isinstance(good, float) and type(value) in (int, float)  # a valid float
            if (type(value) is not type(good) and not number) or field in ("mode", "state"):
                out.append((field, value))
    return out


@pytest.mark.parametrize(("field", "value"), _wrong_values())
def test_a_wrongly_typed_field_is_refused_naming_it(field: str, value: Any) -> None:
    sd = {**_state(), field: value}
    with pytest.raises(RerunConfigError, match=f"state_dict(\\[{field!r}\\]| {field} \\()"):
        RerunStateMachine(mode="validate_results").load_state_dict(sd)


@pytest.mark.parametrize(
    "part",
    [("python", (1, (), None)), ("numpy", ("MT19937", 1, 2, 3, 4)), ("torch_cpu", torch.ones(3))],
)
def test_rng_states_no_generator_accepts_are_refused_at_load(part: tuple[str, Any]) -> None:
    snap = capture()
    rng = {"python": snap.python, "numpy": snap.numpy, "torch_cpu": snap.torch_cpu,
           "cuda": None, "extra": None, part[0]: part[1]}  # fmt: skip
    before = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    sd = {**_state(), "state": "will_rerun_elsewhere", "rng": _saved(rng)}
    with pytest.raises(RerunConfigError, match=r"state_dict\['rng'\].*not the RNG states"):
        RerunStateMachine(mode="validate_results").load_state_dict(sd)
    # tried on throwaway generators: the process's own RNGs are untouched
    assert random.getstate() == before[0]
    assert (np.random.get_state()[1] == before[1]).all()
    assert torch.equal(torch.get_rng_state(), before[2])


def test_microbatches_of_the_wrong_shape_are_refused() -> None:
    sd = {**_state(), "state": "will_rerun_elsewhere", "data": _saved({"not": "a list"})}
    with pytest.raises(RerunConfigError, match=r"state_dict\['data'\] holds a dict"):
        RerunStateMachine(mode="validate_results").load_state_dict(sd)


def test_the_state_it_writes_loads() -> None:
    RerunStateMachine(mode="validate_results").load_state_dict(_state())
