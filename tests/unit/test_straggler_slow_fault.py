"""The ``slow`` fault kind (``inprocess.faults``): recorded once, applied by the caller from
then on in the process it fired in, as busy CPU time."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest

from restartable.inprocess import faults
from restartable.inprocess.errors import ConfigError
from restartable.inprocess.faults.record import append


def test_slow_is_a_lasting_kind_in_plans() -> None:
    kind = faults.kind_of("slow")
    assert kind.lasting and not kind.numeric and not kind.loses_rank
    assert faults.parse_plan("slow@rank1:step100", steps=200) == [
        faults.PlannedFault("slow", 1, 100)
    ]
    assert "slow" in faults.plan_help() and "3x slower" in faults.plan_help()


def test_slow_fires_once_and_slows_only_its_own_process(tmp_path: Path) -> None:
    assert faults.slowdown(tmp_path) == 1.0
    fault = faults.PlannedFault("slow", 0, 5)
    fired = faults.trigger(fault, record_dir=tmp_path, initial_rank=0, iteration=0, step=5)
    assert fired is True  # recorded, returned: nothing happened yet
    assert faults.trigger(fault, record_dir=tmp_path, initial_rank=0, iteration=0, step=5) is False
    assert faults.slowdown(tmp_path) == faults.SLOW_FACTOR == 3.0
    # A reserve that took the slow rank's place (another process) is not slow.
    (record,) = faults.fired(tmp_path)
    other = tmp_path / "other"
    append(other, dataclasses.replace(record, pid=record.pid + 1))
    assert faults.slowdown(other) == 1.0


def test_fire_refuses_slow() -> None:
    with pytest.raises(ConfigError, match=r"kind \('slow'\) is applied by the caller"):
        faults.fire("slow")


def test_burn_uses_cpu_time_not_sleep() -> None:
    c0 = time.process_time()
    faults.burn(0.03)
    assert time.process_time() - c0 >= 0.03
