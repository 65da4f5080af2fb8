"""RestartConfig validation, the decorator's arguments, context() misuse, faults, progress."""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
from collections.abc import Callable

import pytest

from restartable.inprocess import RestartConfig, context, restartable
from restartable.inprocess.errors import ConfigError, ContextError, InprocessError
from restartable.inprocess.faults import inject
from restartable.inprocess.restart.progress import ProgressTracker
from tests.fake_clock import FakeClock


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"soft_timeout": 60.0, "hard_timeout": 30.0},
            "hard_timeout (30.0) must be greater than soft_timeout (60.0): raise hard_timeout",
        ),
        ({"soft_timeout": 0}, "soft_timeout (0) must be a finite number of seconds > 0"),
        ({"barrier_timeout": -1.0}, "barrier_timeout (-1.0) must be"),
        ({"completion_timeout": float("inf")}, "completion_timeout (inf) must be"),
        ({"soft_timeout": "60"}, "soft_timeout ('60') must be"),
        (
            {"heartbeat_interval": 100.0},
            "heartbeat_interval (100.0) must be less than",
        ),
        (
            {"heartbeat_interval": 5.0, "heartbeat_timeout": 5.0},
            "heartbeat_timeout (5.0) must be greater than heartbeat_interval (5.0)",
        ),
        ({"max_iterations": 0}, "max_iterations (0) must be an integer >= 1 or None"),
        ({"max_same_fault": 0}, "max_same_fault (0) must be an integer >= 1"),
        (
            {"active_world_size": 2, "min_active_world_size": 3},
            "min_active_world_size (3) must be <= active_world_size (2)",
        ),
        ({"granularity": "gpu"}, "granularity ('gpu') must be one of ('rank', 'node')"),
        ({"termination_grace_time": -1}, "termination_grace_time (-1) must be >= 0"),
        # inf was accepted: the watchdog then crashed and never killed a hung rank.
        ({"termination_grace_time": float("inf")}, "termination_grace_time (inf) must be >= 0"),
        ({"backend": ""}, "backend ('') must be a non-empty backend name"),
        ({"prewarm": 3}, "prewarm (3) must be callable"),
        ({"health_checks": [print, "x"]}, "health_checks[1] ('x') must be callable"),
        (
            {"rank_section_timeouts": {"steps": 10.0}},
            "rank_section_timeouts has an unknown section ('steps'): use one of "
            "('setup', 'step', 'checkpointing')",
        ),
        (
            {"rank_section_timeouts": {"step": 0}},
            "rank_section_timeouts['step'] (0) must be a finite number of seconds > 0",
        ),
        ({"rank_section_timeouts": [("step", 1.0)]}, "rank_section_timeouts ([('step', 1.0)])"),
        ({"rank_out_of_section_timeout": -5}, "rank_out_of_section_timeout (-5) must be"),
        ({"safety_factor": 0.5}, "safety_factor (0.5) must be a finite number > 1"),
        ({"calculate_timeouts": "yes"}, "calculate_timeouts ('yes') must be True or False"),
        ({"freeze_gc": 1}, "freeze_gc (1) must be True or False: pass a bool, not a int"),
        ({"timeouts_state_path": ""}, "timeouts_state_path ('') must be a file path"),
    ],
)
def test_bad_values_name_field_value_rule_and_fix(options: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        RestartConfig(**options)
    assert message in str(info.value)
    assert ": " in str(info.value)  # ... followed by the fix
    assert isinstance(info.value, ValueError) and isinstance(info.value, InprocessError)


def test_config_is_frozen_keyword_only_and_the_decorator_takes_the_same_names() -> None:
    cfg = RestartConfig(soft_timeout=1.0, hard_timeout=2.0, heartbeat_interval=0.5)
    with pytest.raises(AttributeError):
        cfg.soft_timeout = 5.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        RestartConfig(1.0)  # type: ignore[misc]
    f = restartable(soft_timeout=1.0, hard_timeout=2.0, heartbeat_interval=0.5)(lambda: None)
    assert f.config == cfg  # type: ignore[attr-defined]
    g = restartable(config=cfg)(lambda: None)
    assert g.config is cfg  # type: ignore[attr-defined]
    assert restartable(lambda: None).config == RestartConfig()  # type: ignore[attr-defined]
    assert RestartConfig(health_checks=[print]).health_checks == (print,)


def test_decorator_misuse_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="pass one of them"):
        restartable(config=RestartConfig(), soft_timeout=1.0)
    with pytest.raises(ConfigError, match="soft_timout"):
        restartable(soft_timout=1.0)


def test_world_dependent_values_are_checked_against_the_world() -> None:
    with pytest.raises(ConfigError, match=r"active_world_size \(8\) must be <= WORLD_SIZE \(4\)"):
        RestartConfig(active_world_size=8).validate_world(4)
    RestartConfig(active_world_size=4).validate_world(4)


def test_context_outside_train_says_where_to_call_it() -> None:
    with pytest.raises(ContextError, match="outside a @restartable function"):
        context()
    with pytest.raises(ContextError):
        inject("raise", rank=0)


def test_unknown_fault_kind_is_rejected() -> None:
    with pytest.raises(ConfigError, match="kind \\('explode'\\) must be one of"):
        inject("explode", rank=0)


_SYNC_S = 10.0  # real-time bound of each wait on the other thread: reached only when broken


def _until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + _SYNC_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {_SYNC_S} s: {what}")
        time.sleep(0.001)


def _block_in_c(fd: int) -> None:
    # One C call that releases the GIL: from this frame's first instruction until the read
    # returns, the main thread runs no eval-breaker check, so no pending call (probe) can run.
    os.read(fd, 1)


def test_progress_goes_stale_only_while_the_main_thread_is_blocked() -> None:
    clock = FakeClock()
    progress = ProgressTracker(clock=clock.clock())
    main_thread = threading.get_ident()
    busy_over = threading.Event()
    unblock_r, unblock_w = os.pipe()
    samples: dict[str, float] = {}
    errors: list[BaseException] = []

    def progress_seen() -> bool:
        progress.poke()
        return progress.stalled_for() == 0.0

    def main_blocked() -> bool:
        frame = sys._current_frames().get(main_thread)
        return frame is not None and frame.f_code is _block_in_c.__code__

    def monitor() -> None:  # plays the monitor thread: pokes once per check interval (1 s)
        unblocked = False
        try:
            for _ in range(5):  # main thread busy running bytecode: every probe runs
                clock.advance(1.0)
                _until(progress_seen, "the busy main thread ran the probe")
            samples["busy"] = progress.stalled_for()
            busy_over.set()
            _until(main_blocked, "the main thread blocked in os.read")
            progress.poke()  # collects a probe run on the way in; the next one cannot run
            for _ in range(6):
                clock.advance(1.0)
                progress.poke()
            samples["blocked"] = progress.stalled_for()
            os.write(unblock_w, b"x")
            unblocked = True
            _until(progress_seen, "the unblocked main thread ran the probe")
            samples["unblocked"] = progress.stalled_for()
        except BaseException as exc:
            errors.append(exc)
        finally:
            busy_over.set()
            if not unblocked:
                os.write(unblock_w, b"x")

    t = threading.Thread(target=monitor)
    t.start()
    try:
        while not busy_over.is_set():
            pass
        _block_in_c(unblock_r)
        t.join(3 * _SYNC_S)
    finally:
        os.close(unblock_r)
        os.close(unblock_w)
    progress.close()
    assert not t.is_alive() and not errors, errors
    assert samples["busy"] == 0.0
    assert samples["blocked"] >= 6.0  # six check intervals without a probe running
    assert samples["unblocked"] == 0.0
    clock.advance(3.0)  # closed: no more pokes, so the stall grows with the clock ...
    assert progress.stalled_for() == 3.0
    with progress.paused():  # ... except inside a framework wait
        assert progress.stalled_for() == 0.0


def test_setting_only_the_two_timeouts_gives_a_working_config() -> None:
    # The heartbeat interval is derived from hard_timeout when unset (it used to stay at 30 s
    # and reject any hard_timeout <= 30).
    cfg = RestartConfig(soft_timeout=10, hard_timeout=20)
    assert cfg.heartbeat_interval is None
    assert cfg.effective_heartbeat_interval == pytest.approx(20 / 3)
    assert RestartConfig().effective_heartbeat_interval == 30.0  # NVIDIA's default
    assert RestartConfig(heartbeat_interval=2.0).effective_heartbeat_interval == 2.0
    # Derived, not stored: replace() derives it again for the new hard_timeout.
    assert dataclasses.replace(cfg, hard_timeout=12).effective_heartbeat_interval == 4.0


def test_heartbeat_timeout_is_ignored_with_a_warning_and_checked_only_against_a_set_interval() -> (
    None
):
    with pytest.warns(UserWarning, match=r"heartbeat_timeout \(10\) is ignored"):
        cfg = RestartConfig(heartbeat_timeout=10)  # below the derived 30 s interval: fine
    assert cfg.effective_heartbeat_interval == 30.0
    with pytest.raises(ConfigError, match=r"heartbeat_timeout \(5.0\) must be greater"):
        RestartConfig(heartbeat_interval=5.0, heartbeat_timeout=5.0)


def test_section_timeouts_are_read_only_and_give_the_configured_bounds() -> None:
    cfg = RestartConfig(
        calculate_timeouts=True,
        rank_section_timeouts={"setup": 600, "step": 180, "checkpointing": 420},
        rank_out_of_section_timeout=300,
        timeouts_state_path="runs/x/ft_state.json",
    )
    assert cfg.section_limits == {
        "setup": 600.0,
        "step": 180.0,
        "checkpointing": 420.0,
        "out_of_section": 300.0,
    }
    with pytest.raises(TypeError):
        cfg.rank_section_timeouts["step"] = 1.0  # type: ignore[index]


def test_a_state_path_without_calculate_timeouts_warns_that_it_is_ignored() -> None:
    with pytest.warns(UserWarning, match="timeouts_state_path .* is ignored: calculate_timeouts"):
        RestartConfig(timeouts_state_path="ft_state.json")


@pytest.mark.parametrize("flag", ["--stop-grace", "--node-timeout", "--monitor-interval"])
def test_the_launcher_refuses_an_infinite_duration(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from restartable.inprocess.launch.cli import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--nproc-per-node", "1", flag, "inf", "train.py"])
    assert f"{flag} (inf) must be" in capsys.readouterr().err
