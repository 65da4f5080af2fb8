"""The config's fault drill (``RestartConfig.simulate_fault``, Megatron-Bridge names): its
validation, and which process fires it (exactly one, once per job) on an in-memory store."""

from __future__ import annotations

import dataclasses
import logging
import random
import warnings

import pytest
import torch.distributed as dist

from restartable.inprocess.config import RestartConfig
from restartable.inprocess.errors import ConfigError
from restartable.inprocess.faults import drill
from restartable.inprocess.launch.cli import parse_args
from restartable.inprocess.launch.rank_env import rank_env
from restartable.inprocess.protocol.environment import LaunchEnv, read_env


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"simulate_fault": "yes"}, "simulate_fault ('yes') must be True or False"),
        (
            {"simulate_fault": True, "simulated_fault_type": "rank_crashed"},
            "simulated_fault_type ('rank_crashed') must be one of ('rank_hung', 'rank_killed', "
            "'random')",
        ),
        (
            {"simulate_fault": True, "simulated_fault_rank": -1},
            "simulated_fault_rank (-1) must be an integer >= 0 (a RANK of the job) or None",
        ),
        (
            {"simulate_fault": True, "simulated_fault_rank": True},
            "simulated_fault_rank (True) must be an integer",
        ),
        (
            {"simulate_fault": True, "simulated_fault_base_delay": -1.0},
            "simulated_fault_base_delay (-1.0) must be a finite number of seconds >= 0",
        ),
        (
            {"simulate_fault": True, "simulated_fault_base_delay": float("inf")},
            "simulated_fault_base_delay (inf) must be a finite",
        ),
    ],
)
def test_bad_drill_settings_name_field_value_rule_and_fix(options: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        RestartConfig(**options)
    assert message in str(info.value)
    assert ":" in str(info.value).split(message)[-1]  # and a fix after the rule


def test_the_drill_rank_is_checked_against_the_world() -> None:
    cfg = RestartConfig(simulate_fault=True, simulated_fault_rank=4)
    with pytest.raises(ConfigError, match=r"simulated_fault_rank \(4\) must be < WORLD_SIZE"):
        cfg.validate_world(4)
    cfg.validate_world(5)


def test_drill_settings_without_simulate_fault_warn_that_they_are_ignored() -> None:
    with pytest.warns(UserWarning, match=r"simulated_fault_type \('rank_killed'\) is ignored: "):
        RestartConfig(simulated_fault_type="rank_killed")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RestartConfig()  # the defaults say nothing
        RestartConfig(simulate_fault=True, simulated_fault_rank=0)


def _env(rank: int, *, generation: int = 0, world: int = 4, launch_round: int = 0) -> LaunchEnv:
    return LaunchEnv(
        rank=rank,
        local_rank=rank,
        world_size=world,
        local_world_size=world,
        master_addr="127.0.0.1",
        master_port=1,
        store_hosted=True,
        respawn_generation=generation,
        launch_round=launch_round,
    )


# A delay no test waits for: the drill is cancelled (close) before it could fire.
_NEVER = {"simulate_fault": True, "simulated_fault_base_delay": 3600.0}


def test_a_random_target_is_the_same_on_every_rank_and_only_it_arms() -> None:
    store = dist.HashStore()
    cfg = RestartConfig(**_NEVER)
    drills = [drill.start_in_rank(cfg, _env(r), store, rng=random.Random(r)) for r in range(4)]
    armed = [d for d in drills if d is not None]
    try:
        assert len(armed) == 1  # every rank proposed; the first proposal stored won
        (d,) = armed
        assert d.rank == int(store.get(drill.TARGET_KEY))
        assert d.kind in ("rank_killed", "rank_hung")  # "random" picks one of the two
        assert 3600.0 <= d.delay <= 7200.0
    finally:
        for d in armed:
            d.close()


@pytest.mark.parametrize(
    ("generation", "environ"),
    [
        (1, {}),  # a respawned process: the job's drill already fired in its predecessor
        (0, {"INPROCESS_LAUNCH_ROUND": "1"}),  # after an in-job restart
        (0, {"TORCHELASTIC_RESTART_COUNT": "2"}),  # after a torchrun restart
    ],
)
def test_the_drill_fires_once_per_job_not_after_a_restart(
    generation: int, environ: dict[str, str]
) -> None:
    cfg = RestartConfig(**_NEVER, simulated_fault_rank=1, simulated_fault_type="rank_killed")
    store = dist.HashStore()
    base = {"RANK": "1", "WORLD_SIZE": "4", "MASTER_PORT": "1"}
    later = read_env({**base, **environ, "INPROCESS_RESPAWN_GENERATION": str(generation)})
    assert drill.start_in_rank(cfg, later, store) is None
    first = drill.start_in_rank(cfg, read_env({**base, "INPROCESS_LAUNCH_ROUND": "0"}), store)
    assert first is not None and (first.kind, first.rank) == ("rank_killed", 1)
    first.close()
    assert drill.start_in_rank(cfg, _env(0), store) is None  # not the target
    assert drill.start_in_rank(RestartConfig(), _env(1), store) is None  # off


def test_the_launcher_tells_each_rank_its_round_and_launch() -> None:
    args = parse_args(["--nproc-per-node", "2", "t.py"])
    env = rank_env(args, 0, 1234, round_=2, launch_id="20261122-203815-1a2b3c")
    assert env["INPROCESS_LAUNCH_ROUND"] == "2"
    assert env["RESTARTABLE_LAUNCH_ID"] == "20261122-203815-1a2b3c"
    assert read_env(env).launch_round == 2


def test_a_drill_that_loses_its_rank_with_no_reserve_nor_respawn_warns_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cfg = RestartConfig(**_NEVER, simulated_fault_rank=1, simulated_fault_type="rank_killed")
    with caplog.at_level(logging.WARNING, logger="restartable.inprocess.faults.drill"):
        armed = drill.start_in_rank(cfg, _env(1), dist.HashStore())
    assert armed is not None
    armed.close()
    (line,) = [r.getMessage() for r in caplog.records]
    assert "no warm reserve and respawn off" in line and "shrink to 3 ranks" in line
    caplog.clear()
    # A reserve (active_world_size < world) or respawn replaces it: nothing to say.
    for cfg2, env in (
        (RestartConfig(**_NEVER, simulated_fault_rank=1, active_world_size=3), _env(1)),
        (cfg, dataclasses.replace(_env(1), max_respawns=1)),
    ):
        with caplog.at_level(logging.WARNING, logger="restartable.inprocess.faults.drill"):
            d = drill.start_in_rank(cfg2, env, dist.HashStore())
        assert d is not None
        d.close()
    assert not caplog.records
