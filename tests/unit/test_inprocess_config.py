"""RestartConfig validation, the decorator's arguments, context() misuse, faults, progress."""

from __future__ import annotations

import threading
import time

import pytest

from inprocess import RestartConfig, context, restartable
from inprocess.errors import ConfigError, ContextError, InprocessError
from inprocess.faults import inject
from inprocess.progress import ProgressTracker


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
        ({"backend": ""}, "backend ('') must be a non-empty backend name"),
        ({"prewarm": 3}, "prewarm (3) must be callable"),
        ({"health_checks": [print, "x"]}, "health_checks[1] ('x') must be callable"),
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


def test_progress_goes_stale_only_while_the_main_thread_is_blocked() -> None:
    progress = ProgressTracker()
    samples: dict[str, float] = {}

    def monitor() -> None:
        for _ in range(5):  # main thread busy running bytecode
            progress.poke()
            time.sleep(0.05)
        samples["busy"] = progress.stalled_for()
        time.sleep(0.1)  # main thread now blocked in time.sleep: the probe stays pending
        for _ in range(6):
            progress.poke()
            time.sleep(0.05)
        samples["blocked"] = progress.stalled_for()

    t = threading.Thread(target=monitor)
    t.start()
    end = time.monotonic() + 0.3
    while time.monotonic() < end:
        pass
    time.sleep(0.6)
    t.join()
    progress.close()
    assert samples["busy"] < 0.2
    assert samples["blocked"] > 0.3
    with progress.paused():
        assert progress.stalled_for() == 0.0
