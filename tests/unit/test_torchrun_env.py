"""The torchrun environment: the launcher's defaults and each iteration's RANK, LOCAL_RANK, ..."""

from __future__ import annotations

import pytest

from restartable.inprocess.launch.cli import parse_args
from restartable.inprocess.launch.rank_env import rank_env, torchrun_defaults
from restartable.inprocess.restart.torchrun_env import export, iteration_env


def test_launcher_sets_omp_num_threads_1_for_several_ranks_unless_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Found by a user: without it each rank's intra-op pool took every core and nanoGPT's step
    # was 3x torchrun's.
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    env = rank_env(parse_args(["--nproc-per-node", "3", "x.py"]), 1, 1234)
    assert env["OMP_NUM_THREADS"] == "1"
    assert "OMP_NUM_THREADS" not in rank_env(parse_args(["--nproc-per-node", "1", "x.py"]), 0, 1)
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert rank_env(parse_args(["--nproc-per-node", "3", "x.py"]), 1, 1)["OMP_NUM_THREADS"] == "4"
    assert torchrun_defaults(2, {"OMP_NUM_THREADS": "2"}) == {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"
    }


def test_launcher_sets_torchruns_variables() -> None:
    args = parse_args(["--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "1", "x.py"])
    env = rank_env(args, 1, 29500, round_=2)
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")} == {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
    }
    assert env["GROUP_RANK"] == "1" and env["GROUP_WORLD_SIZE"] == "2"
    assert env["ROLE_RANK"] == "3" and env["ROLE_WORLD_SIZE"] == "4"
    assert env["TORCHELASTIC_RESTART_COUNT"] == "2"
    # our store listens on MASTER_PORT: a script's env:// init must connect, not bind
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"


def test_reserve_that_replaced_rank_0_gets_rank_0_and_local_rank_0() -> None:
    # Found by a user: the DDP tutorial saves its snapshot `if LOCAL_RANK == 0`; after rank 0's
    # process died and the reserve (launch local rank 2) became rank 0, LOCAL_RANK stayed 2 in
    # every process and no snapshot was written again.
    env = iteration_env(me=2, active=(2, 1), node_of=(0, 0, 0), launch_local_rank=2)
    assert env["RANK"] == "0" and env["WORLD_SIZE"] == "2"
    assert env["LOCAL_RANK"] == "0" and env["LOCAL_WORLD_SIZE"] == "2"
    assert env["INPROCESS_LAUNCH_LOCAL_RANK"] == "2"  # the device it owns does not move
    other = iteration_env(me=1, active=(2, 1), node_of=(0, 0, 0), launch_local_rank=1)
    assert other["RANK"] == "1" and other["LOCAL_RANK"] == "1"


def test_local_and_group_ranks_count_active_ranks_per_node() -> None:
    # 2 nodes x 2; node 0's rank 1 lost, node 1's reserve 3 takes its place as rank 1.
    node_of = (0, 0, 1, 1)
    got = {
        me: iteration_env(me=me, active=(0, 3, 2), node_of=node_of, launch_local_rank=me % 2)
        for me in (0, 3, 2)
    }
    assert [got[m]["RANK"] for m in (0, 3, 2)] == ["0", "1", "2"]
    assert [got[m]["LOCAL_RANK"] for m in (0, 3, 2)] == ["0", "0", "1"]
    assert [got[m]["LOCAL_WORLD_SIZE"] for m in (0, 3, 2)] == ["1", "2", "2"]
    assert [got[m]["GROUP_RANK"] for m in (0, 3, 2)] == ["0", "1", "1"]
    assert {got[m]["GROUP_WORLD_SIZE"] for m in (0, 3, 2)} == {"2"}
    assert [got[m]["INPROCESS_LAUNCH_GROUP_RANK"] for m in (0, 3, 2)] == ["0", "1", "1"]
    # a respawned identity (slot + generation x world) keeps its slot's node
    assert (
        iteration_env(me=5, active=(0, 5), node_of=node_of, launch_local_rank=1)["LOCAL_RANK"]
        == "1"
    )


def test_export_writes_the_environment_and_a_reserve_has_none() -> None:
    environ: dict[str, str] = {"RANK": "2"}
    export({"RANK": "0"}, environ)
    assert environ == {"RANK": "0"}
    with pytest.raises(ValueError, match="not active"):
        iteration_env(me=4, active=(0, 1), node_of=(0, 0, 0, 0, 0), launch_local_rank=0)


def test_a_second_init_process_group_in_train_is_named_with_the_fix() -> None:
    from restartable.inprocess.errors import ConfigError
    from restartable.inprocess.restart.process_group import own_group_misuse

    err = own_group_misuse(ValueError("trying to initialize the default process group twice!"))
    assert isinstance(err, ConfigError)
    assert "delete the init_process_group call" in str(err)
    assert own_group_misuse(ValueError("bad shape")) is None


def test_a_script_that_binds_master_port_itself_joins_the_jobs_store(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A torchrun script that hosts its own TCPStore on MASTER_PORT (is_master=True on rank 0),
    # where the launcher's store already listens: with the environment the launcher gives each
    # rank, as torchrun does, torch joins that store as a client instead of failing with
    # EADDRINUSE, and the script's keys are shared by its ranks.
    import datetime

    import torch.distributed as dist

    jobs = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = rank_env(parse_args(["--nproc-per-node", "2", "x.py"]), 0, jobs.port, round_=0)
    for name in ("TORCHELASTIC_USE_AGENT_STORE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(name, env[name])
    own = dist.TCPStore(
        env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=True,
        timeout=datetime.timedelta(seconds=10),
    )  # fmt: skip
    own.set("script-key", b"1")
    assert jobs.get("script-key") == b"1"
