"""Script mode's pieces in one process: which scripts it wraps, its config, the script's own
``init_process_group`` call, and what a run leaves behind."""

from __future__ import annotations

import atexit
import datetime
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from restartable.inprocess.errors import ConfigError
from restartable.inprocess.script_mode.config_env import CONFIG_ENV, script_config
from restartable.inprocess.script_mode.detect import restart_in_place
from restartable.inprocess.script_mode.leftovers import Leftovers
from restartable.inprocess.script_mode.own_group import iteration_group_answers


@pytest.mark.parametrize(
    ("source", "wrapped"),
    [
        ("import torch\nfrom torch.distributed import init_process_group\n", True),
        ("from restartable.inprocess import restartable\n", False),
        ("import restartable.inprocess.lightning as il\n", False),
        ("@my.restartable\ndef train(): pass\n", False),
        ("# this script is not restartable_by_hand\n", True),
        # the user's own modules that share our old top-level names (names: keep)
        ("import checkpoint\nimport inprocess\nfrom rerun import x\n", True),
    ],
)
def test_only_scripts_that_do_not_drive_the_loop_are_wrapped(
    tmp_path: Path, source: str, wrapped: bool
) -> None:
    script = tmp_path / "train.py"
    script.write_text(source)
    launched = {"INPROCESS_LAUNCH_ROUND": "0"}
    assert restart_in_place(str(script), launched) is wrapped
    assert restart_in_place(str(script), {**launched, "INPROCESS_RESTART_IN_PLACE": "0"}) is False
    assert restart_in_place(str(script), {}) is False  # not started by inprocess.launch


def test_config_comes_from_the_environment_and_errors_name_the_variable() -> None:
    assert script_config({}).active_world_size is None
    cfg = script_config({CONFIG_ENV: '{"active_world_size": 2, "soft_timeout": 5}'})
    assert (cfg.active_world_size, cfg.soft_timeout) == (2, 5)
    for bad, words in (
        ("{active_world_size: 2}", "is not JSON"),
        ("[2]", "is not a JSON object"),
        (
            '{"active_wrld_size": 2}',
            "the keys are the fields of restartable.inprocess.RestartConfig",
        ),
        ('{"init_process_group": false}', "must stay true"),
    ):
        with pytest.raises(ConfigError, match=words) as err:
            script_config({CONFIG_ENV: bad})
        assert CONFIG_ENV in str(err.value)


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    store = dist.HashStore()
    dist.init_process_group(
        "gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=10)
    )
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_the_scripts_init_process_group_gets_the_iteration_group(one_rank_group: None) -> None:
    said: list[str] = []
    real = dist.init_process_group
    real_destroy = dist.destroy_process_group
    with iteration_group_answers(lambda key, line: said.append(line)):
        from torch.distributed import init_process_group  # as a script imports it

        init_process_group(backend="gloo")
        dist.init_process_group("gloo", rank=0, world_size=1)
        assert said == []
        dist.init_process_group(backend="nccl")
        assert "asked init_process_group for backend 'nccl'" in said[0]
        assert '{"backend": "nccl"}' in said[0]
        with pytest.raises(ConfigError, match="rank 0: read RANK / WORLD_SIZE"):
            dist.init_process_group("gloo", rank=1)
        from torch.distributed import destroy_process_group

        destroy_process_group()  # the script's, at its end: left to the loop
        assert dist.is_initialized()
        # The monitor's abort (another thread) destroys it.
        t = threading.Thread(target=dist.destroy_process_group)
        t.start()
        t.join()
        assert not dist.is_initialized()
        with pytest.raises(ConfigError, match="after destroying this iteration's group"):
            dist.init_process_group("gloo")
    assert dist.init_process_group is real and dist.destroy_process_group is real_destroy


def test_what_a_run_leaves_running_is_warned_once_per_kind(tmp_path: Path) -> None:
    said: dict[str, str] = {}
    leftovers = Leftovers(lambda key, line: said.setdefault(key, line))
    stop = threading.Event()
    threads: list[threading.Thread] = []
    files = []

    def handler() -> None:
        pass

    try:
        for run in range(3):
            leftovers.before_run()
            t = threading.Thread(target=stop.wait, name=f"poller-{run}", daemon=True)
            t.start()
            threads.append(t)
            files.append(open(tmp_path / "log.txt", "a"))  # noqa: SIM115 - the leak under test
            atexit.register(handler)
            leftovers.after_run()
            if run == 0:  # the first run's registrations may be its imports': not judged
                assert "atexit" not in said
        leftovers.before_run()
    finally:
        stop.set()
        for f in files:
            f.close()
        for _ in range(3):
            atexit.unregister(handler)
    assert "poller-" in said["threads"] and "still run" in said["threads"]
    assert "log.txt" in said["files"] and "with open" in said["files"]
    assert "registered 1 atexit handler(s)" in said["atexit"]
    assert "processes" not in said


def test_a_run_that_cleans_up_leaves_nothing_to_warn_about(tmp_path: Path) -> None:
    said: list[str] = []
    leftovers = Leftovers(lambda key, line: said.append(line))
    for _ in range(3):
        leftovers.before_run()
        t = threading.Thread(target=lambda: None)
        t.start()
        t.join()
        with open(tmp_path / "log.txt", "a") as f:
            f.write("x")
        leftovers.after_run()
    leftovers.before_run()
    assert said == []
