"""inprocess.faults: the kind table, plan parsing, fire-once claims and the crash-safe record."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import pytest

from restartable.inprocess import faults
from restartable.inprocess.context import RestartContext, activated
from restartable.inprocess.errors import ConfigError
from restartable.inprocess.faults import FiredFault, InjectedFault, PlannedFault, parse_plan
from restartable.inprocess.faults.record import RECORD_FILE, append
from restartable.inprocess.restart.progress import ProgressTracker
from tests.multiproc import REPO_ROOT

FIRED_KINDS = ("exception", "kill", "hang", "hang_gil", "sigterm")


@contextmanager
def in_train(*, rank: int, initial_rank: int, iteration: int) -> Iterator[None]:
    """What ``context()`` returns inside a ``@restartable`` call, for the parts faults read."""
    ctx = RestartContext(
        iteration=iteration,
        rank=rank,
        world_size=4,
        initial_rank=initial_rank,
        active_ranks=(0, 1, 2, 3),
        store=None,
        last_restart=None,
        _progress=ProgressTracker(),
        _interrupter=cast(Any, None),  # faults never interrupt
    )
    with activated(ctx):
        yield


# --- the table and the plan ---------------------------------------------------------------------


def test_table_holds_each_kind_and_the_old_names_are_aliases() -> None:
    kinds = (*FIRED_KINDS[:4], "nan", "sigterm", "slow", "sdc", "sdc-once")
    assert tuple(faults.KINDS) == kinds
    assert {k for k, v in faults.KINDS.items() if v.loses_rank} == {"kill", "hang_gil"}
    assert [k for k, v in faults.KINDS.items() if v.numeric] == ["nan", "sdc-once"]
    assert {old: faults.kind_of(old).name for old in faults.ALIASES} == {
        "raise": "exception",
        "sigkill_self": "kill",
        "hang_gil_released": "hang",
        "hang_gil_held": "hang_gil",
        "sigterm_self": "sigterm",
    }
    with pytest.raises(ConfigError, match=r"kind \('explode'\) must be one of \('exception'"):
        faults.kind_of("explode")
    assert all(f"  {k}" in faults.plan_help() for k in faults.KINDS)  # --help lists every kind


def test_parse_plan_good() -> None:
    plan = parse_plan(" exception@rank1:step30, kill@rank2:step60 ", steps=100, world_size=3)
    assert plan == [PlannedFault("exception", 1, 30), PlannedFault("kill", 2, 60)]
    assert [f.name for f in plan] == ["exception@rank1:step30", "kill@rank2:step60"]
    assert [f.loses_rank for f in plan] == [False, True]


@pytest.mark.parametrize("kind", [*faults.KINDS])
def test_parse_plan_each_kind(kind: str) -> None:
    assert parse_plan(f"{kind}@rank0:step9", steps=10) == [PlannedFault(kind, 0, 9)]


def test_parse_plan_demo_and_none() -> None:
    demo = parse_plan("demo", steps=300, world_size=2)
    assert [f.name for f in demo] == [
        "exception@rank1:step50",
        "kill@rank1:step100",
        "hang@rank0:step150",
        "nan@rank1:step200",
        "exception@rank0:step250",
    ]
    assert parse_plan("none", steps=10) == []
    assert parse_plan("", steps=10) == []
    with pytest.raises(ConfigError, match=r"'exception@rank1:step50' \(of the demo plan\)"):
        parse_plan("demo", steps=300, world_size=1)


@pytest.mark.parametrize(
    ("text", "world_size", "expected"),
    [
        ("boom@rank1:step3", None, ["'boom@rank1:step3'", "KIND@rankR:stepS", "'hang_gil'"]),
        ("raise@rank1:step3", None, ["'raise@rank1:step3'", "KIND@rankR:stepS"]),
        ("exception@1:3", None, ["'exception@1:3'", "write e.g. exception@rank1:step30"]),
        ("exception@rank1:step3,", None, ["item ''", "KIND@rankR:stepS"]),
        ("exception@rank1:step300", None, ["'exception@rank1:step300'", "(0..299)", "earlier"]),
        ("exception@rank9:step10", 4, ["'exception@rank9:step10'", "ranks 0..3", "a rank below 4"]),
        ("nan@rank1:step3,nan@rank1:step3", None, ["'nan@rank1:step3' appears twice", "remove"]),
    ],
)
def test_parse_plan_rejects_bad_items_by_name(
    text: str, world_size: int | None, expected: list[str]
) -> None:
    with pytest.raises(ValueError) as err:
        parse_plan(text, steps=300, world_size=world_size)
    assert all(part in str(err.value) for part in expected), str(err.value)


# --- firing and the record ----------------------------------------------------------------------


def test_exception_is_recorded_before_it_fires(tmp_path: Path) -> None:
    fault = PlannedFault("exception", 1, 5)
    before = time.time()
    with pytest.raises(InjectedFault, match="exception@rank1:step5"):
        faults.trigger(fault, record_dir=tmp_path, initial_rank=3, iteration=2, step=5)
    (record,) = faults.fired(tmp_path)
    assert record == FiredFault(
        fault="exception@rank1:step5",
        kind="exception",
        rank=1,
        initial_rank=3,
        iteration=2,
        step=5,
        time=record.time,
        pid=os.getpid(),
    )
    assert before <= record.time <= time.time()


def test_a_fault_fires_once_per_record_dir(tmp_path: Path) -> None:
    fault = PlannedFault("nan", 0, 7)
    fire = {"record_dir": tmp_path, "initial_rank": 0, "iteration": 0, "step": 7}
    assert faults.trigger(fault, **fire)  # due: the caller applies the NaN
    assert not faults.trigger(fault, **fire)  # the replay of step 7 after a restart
    assert not faults.trigger(fault, **{**fire, "initial_rank": 2, "iteration": 1})  # a reserve
    assert [f.fault for f in faults.fired(tmp_path)] == ["nan@rank0:step7"]
    assert faults.trigger(fault, **{**fire, "record_dir": tmp_path / "other"})  # another run


def test_kill_is_recorded_in_a_process_that_dies_of_sigkill(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import sys
        from restartable.inprocess.faults import PlannedFault, trigger
        fault = PlannedFault("kill", 2, 7)
        trigger(fault, record_dir=sys.argv[1], initial_rank=3, iteration=1, step=7)
        print("survived the kill")
        """
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path)],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        out, _ = child.communicate(timeout=60)
    finally:
        child.kill()
    assert child.returncode == -signal.SIGKILL, out
    assert "survived" not in out
    (record,) = faults.fired(tmp_path)
    assert (record.fault, record.rank, record.initial_rank, record.iteration, record.pid) == (
        "kill@rank2:step7",
        2,
        3,
        1,
        child.pid,
    )
    # The claim outlived the process: the reserve that replays step 7 does not fire it again.
    again = faults.trigger(
        PlannedFault("kill", 2, 7), record_dir=tmp_path, initial_rank=0, iteration=2, step=7
    )
    assert again is False


def test_fired_is_oldest_first_and_skips_a_torn_last_line(tmp_path: Path) -> None:
    assert faults.fired(tmp_path) == []

    def rec(name: str, t: float) -> FiredFault:
        return FiredFault(name, "exception", 0, 0, 0, 1, t, 1)

    for name, t in (("b", 2.0), ("c", 3.0), ("a", 1.0)):
        append(tmp_path, rec(name, t))
    with (tmp_path / RECORD_FILE).open("a") as f:
        f.write('{"fault": "torn", "kind"')  # a write cut short: never a fired fault
    assert [f.fault for f in faults.fired(tmp_path)] == ["a", "b", "c"]


def test_fire_refuses_a_numeric_kind() -> None:
    with pytest.raises(ConfigError, match=r"kind \('nan'\) is applied by the caller"):
        faults.fire("nan")


# --- inject and fire_planned (read the restart context) -----------------------------------------


def test_inject_matches_rank_iteration_and_step(tmp_path: Path) -> None:
    with in_train(rank=1, initial_rank=2, iteration=1):
        want = {"rank": 1, "iteration": 1, "step": 3, "record_dir": tmp_path}
        assert not faults.inject("raise", **{**want, "rank": 0}, current_step=3)
        assert not faults.inject("raise", **{**want, "iteration": 0}, current_step=3)
        assert not faults.inject("raise", **want, current_step=2)
        assert faults.fired(tmp_path) == []
        with pytest.raises(InjectedFault):
            faults.inject("raise", **want, current_step=3)
        assert not faults.inject("raise", **want, current_step=3)  # fired once
        assert faults.inject("nan", rank=1, current_step=8, record_dir=tmp_path)  # apply it
    assert [(f.fault, f.kind, f.initial_rank, f.step) for f in faults.fired(tmp_path)] == [
        ("exception@rank1:iteration1:step3", "exception", 2, 3),
        ("nan@rank1", "nan", 2, 8),
    ]


def test_fire_planned_fires_a_fault_before_claiming_a_nan_at_the_same_step(tmp_path: Path) -> None:
    plan = parse_plan("nan@rank0:step4,exception@rank0:step4,kill@rank1:step4", steps=10)
    with in_train(rank=0, initial_rank=0, iteration=0):
        assert faults.fire_planned(plan, step=3, record_dir=tmp_path) is None
        with pytest.raises(InjectedFault):
            faults.fire_planned(plan, step=4, record_dir=tmp_path)
    with in_train(rank=0, initial_rank=0, iteration=1):  # step 4 replays after the restart
        assert faults.fire_planned(plan, step=4, record_dir=tmp_path) == plan[0]
        assert faults.fire_planned(plan, step=4, record_dir=tmp_path) is None  # the re-run
    assert [(f.kind, f.iteration) for f in faults.fired(tmp_path)] == [
        ("exception", 0),
        ("nan", 1),
    ]


def test_a_plan_that_loses_a_rank_without_reserve_or_respawn_warns_in_one_line() -> None:
    from restartable.inprocess.faults import parse_plan, shrink_warning

    plan = parse_plan("demo", steps=300)
    line = shrink_warning(plan, world_size=4, active=4, max_respawns=0)
    assert line is not None and "\n" not in line
    assert "kill@rank1:step100" in line and "0 warm reserve(s)" in line
    # A reserve, or respawn, replaces the lost rank: nothing to say.
    assert shrink_warning(plan, world_size=4, active=3, max_respawns=0) is None
    assert shrink_warning(plan, world_size=4, active=4, max_respawns=1) is None
    assert shrink_warning(parse_plan("exception@rank0:step5", steps=9), world_size=2, active=2,
                          max_respawns=0) is None  # fmt: skip


def test_a_plan_that_kills_every_process_without_respawn_is_named() -> None:
    from restartable.inprocess.faults import no_rank_left, parse_plan

    def left(text: str, *, world: int, active: int, respawns: int = 0) -> str | None:
        plan = parse_plan(text, steps=30)
        return no_rank_left(plan, world_size=world, active=active, max_respawns=respawns)

    # The case: one process, no reserve, its kill planned.
    line = left("kill@rank0:step10", world=1, active=1)
    assert line is not None and "\n" not in line and "kill@rank0:step10" in line
    assert "no rank would be left" in line and "--max-respawns 1" in line
    assert left("kill@rank0:step5,hang_gil@rank0:step9", world=2, active=2) is not None
    # The first kill shrinks the job to one rank: rank 1's kill never fires.
    assert left("kill@rank0:step5,kill@rank1:step9", world=2, active=2) is None
    # A reserve takes the first kill's place; respawn refills the pool; an exception loses none.
    assert left("kill@rank0:step5,kill@rank0:step9", world=3, active=2) is None
    assert left("kill@rank0:step10", world=1, active=1, respawns=1) is None
    assert left("exception@rank0:step10", world=1, active=1) is None
