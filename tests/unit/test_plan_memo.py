"""PlanMemo reuses exactly what did not change; structure() tells plans apart."""

from __future__ import annotations

import pytest
import torch

from restartable.checkpoint import plain
from restartable.checkpoint.persistent.plan_memo import PlanMemo, structure


def test_load_reuses_the_object_for_the_same_bytes_only() -> None:
    memo = PlanMemo()
    first = memo.load("a", plain.dumps([1, 2]))
    assert memo.load("a", plain.dumps([1, 2])) is first
    changed = memo.load("a", plain.dumps([1, 3]))
    assert changed == [1, 3]
    assert memo.load("b", plain.dumps([1, 3])) is not changed  # slots are separate


def test_derive_recomputes_when_the_key_changes_and_forgets_failures() -> None:
    memo = PlanMemo()
    calls = []

    def compute() -> int:
        calls.append(1)
        return len(calls)

    assert memo.derive("g", (b"x",), compute) == 1
    assert memo.derive("g", (b"x",), compute) == 1  # reused
    assert memo.derive("g", (b"y",), compute) == 2

    def fail() -> int:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        memo.derive("g", (b"z",), fail)
    assert memo.derive("g", (b"y",), compute) == 3  # the failure dropped the cache
    memo.clear()
    assert memo.derive("g", (b"y",), compute) == 4


def test_structure_ignores_values_and_sees_everything_a_plan_depends_on() -> None:
    base = {"w": torch.zeros(2, 3), "opt": {"step": 1, "lr": [0.1]}}
    assert structure(base) == structure({"w": torch.ones(2, 3), "opt": {"step": 7, "lr": [0.5]}})
    variants = [
        {"w": torch.zeros(3, 2), "opt": {"step": 1, "lr": [0.1]}},  # shape
        {"w": torch.zeros(2, 3, dtype=torch.float64), "opt": {"step": 1, "lr": [0.1]}},  # dtype
        {"w": torch.zeros(2, 3), "opt": {"step": 1, "lr": (0.1,)}},  # container kind
        {"w": torch.zeros(2, 3), "opt": {"step": "1", "lr": [0.1]}},  # leaf type
        {"w": torch.zeros(2, 3), "opt": {"step": 1, "lr": [0.1], "extra": 0}},  # keys
        {"w": torch.zeros(2, 3), "opt": {"step": 1, "lr": [torch.zeros(1)]}},  # tensor in list
    ]
    for v in variants:
        assert structure(v) != structure(base), v
