"""Selecting the etcd store: INPROCESS_STORE / INPROCESS_JOB_ID, ``store=``, ``--store``."""

from __future__ import annotations

import pytest

from restartable.checkpoint.sealing import SECRET_ENV, Sealer
from restartable.inprocess import RestartConfig, restartable
from restartable.inprocess.errors import ConfigError
from restartable.inprocess.etcd.url import parse_url
from restartable.inprocess.launch.cli import parse_args
from restartable.inprocess.launch.control_etcd import EtcdRounds
from restartable.inprocess.launch.control_tcp import TcpRounds
from restartable.inprocess.launch.rounds import JobControl
from restartable.inprocess.protocol.environment import read_env, store_setting

URL = "etcd://10.0.0.1:2379,10.0.0.2,[::1]:2380"
BASE = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "29500"}
JOB_VARS = (
    "INPROCESS_STORE",
    "INPROCESS_JOB_ID",
    "SLURM_JOB_ID",
    "SLURM_STEP_ID",
    "TORCHELASTIC_RUN_ID",
)


def test_environment_selects_the_store_and_the_job_id_in_order() -> None:
    env = read_env({**BASE, "INPROCESS_STORE": URL, "SLURM_JOB_ID": "4711"})
    assert (env.store_url, env.job_id) == (URL, "4711")
    env = read_env({**BASE, "INPROCESS_JOB_ID": "mine", "SLURM_JOB_ID": "4711"})
    assert (env.store_url, env.job_id) == (None, "mine")
    assert read_env({**BASE, "TORCHELASTIC_RUN_ID": "run7"}).job_id == "run7"
    # torchrun's default rendezvous id is shared by every job: not an id
    assert read_env({**BASE, "TORCHELASTIC_RUN_ID": "none"}).job_id is None
    assert read_env(BASE).store_url is None  # the default: the TCPStore


@pytest.mark.parametrize("bad", ["http://h:2379", "etcd://h:notaport", "etcd://"])
def test_a_malformed_store_variable_names_the_variable_value_and_form(bad: str) -> None:
    with pytest.raises(ConfigError, match=r"INPROCESS_STORE .*expected etcd://host:port") as e:
        read_env({**BASE, "INPROCESS_STORE": bad})
    assert repr(bad) in str(e.value)


def test_the_config_wins_over_the_variable_and_a_job_id_is_required() -> None:
    env = read_env({**BASE, "INPROCESS_STORE": URL, "INPROCESS_JOB_ID": "j1"})
    assert store_setting(None, env) == URL
    assert store_setting("etcd://other:2379", env) == "etcd://other:2379"
    assert store_setting(None, read_env(BASE)) is None
    no_id = read_env({**BASE, "INPROCESS_STORE": URL})
    with pytest.raises(ConfigError, match="set INPROCESS_JOB_ID to the same value on every rank"):
        store_setting(None, no_id)
    assert store_setting(URL + "/job-in-url", no_id) == URL + "/job-in-url"
    bad_id = read_env({**BASE, "INPROCESS_STORE": URL, "INPROCESS_JOB_ID": "a b"})
    with pytest.raises(ConfigError, match=r"the job id \(INPROCESS_JOB_ID"):
        store_setting(None, bad_id)


def test_config_store_is_validated_and_needs_a_soft_timeout_above_a_leader_election() -> None:
    assert RestartConfig(store=URL, soft_timeout=5, hard_timeout=10).store == URL
    with pytest.raises(ConfigError, match=r"store: store URL \('etcd://h:x'\)"):
        RestartConfig(store="etcd://h:x")
    with pytest.raises(
        ConfigError, match=r"soft_timeout \(2.0\) must be >= 5.0 with the etcd store \(store="
    ):
        RestartConfig(store=URL, soft_timeout=2.0, hard_timeout=5.0)


def test_the_soft_timeout_rule_applies_to_a_store_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in (*JOB_VARS, "INPROCESS_LAUNCHER_PID", "INPROCESS_RESPAWN_GENERATION"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {**BASE, "WORLD_SIZE": "1", "INPROCESS_STORE": URL}.items():
        monkeypatch.setenv(name, value)

    @restartable(soft_timeout=2.0, hard_timeout=5.0)
    def train() -> None:
        raise AssertionError("must not run")

    with pytest.raises(ConfigError, match="set INPROCESS_JOB_ID"):
        train()  # fails before connecting to anything
    monkeypatch.setenv("INPROCESS_JOB_ID", "j1")
    with pytest.raises(ConfigError, match=r"soft_timeout \(2.0\).*INPROCESS_STORE="):
        train()


def test_launcher_store_flag_and_job_id(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in JOB_VARS:
        monkeypatch.delenv(name, raising=False)
    script = ["train.py"]
    assert parse_args(["--nproc-per-node", "2", *script]).store is None
    one = parse_args(["--nproc-per-node", "2", "--store", URL, *script])
    assert one.job_id.startswith("launch-")  # a fresh id per job on one node
    assert parse_args(["--nproc-per-node", "2", "--store", URL, *script]).job_id != one.job_id
    given = parse_args(["--nproc-per-node", "2", "--store", URL, "--job-id", "j9", *script])
    assert given.job_id == "j9"
    several = ["--nproc-per-node", "2", "--nnodes", "2", "--store", URL, *script]
    with pytest.raises(SystemExit):
        parse_args(several)  # every node must agree: no id made up on one of them
    monkeypatch.setenv("SLURM_JOB_ID", "4711")
    assert parse_args(several).job_id == "4711"
    monkeypatch.setenv("SLURM_STEP_ID", "3")  # srun: the job step is the namespace
    assert parse_args(several).job_id == "4711.3"
    for bad in (["--store", "etcd://h:x"], ["--store", URL, "--job-id", "a b"]):
        with pytest.raises(SystemExit):
            parse_args(["--nproc-per-node", "2", *bad, *script])


def test_two_srun_steps_of_one_allocation_get_two_namespaces() -> None:
    # Issue 33: both steps had the namespace SLURM_JOB_ID, so the second one's launcher deleted
    # the first one's keys while it ran.
    slurm = {**BASE, "INPROCESS_STORE": URL, "SLURM_JOB_ID": "4711"}
    first = read_env({**slurm, "SLURM_STEP_ID": "0"})
    second = read_env({**slurm, "SLURM_STEP_ID": "1"})
    assert (first.job_id, second.job_id) == ("4711.0", "4711.1")
    assert store_setting(None, first) == URL  # a valid job id
    batch = read_env({**BASE, "SLURM_JOB_ID": "4711"})  # a batch script: no step id
    assert batch.job_id == "4711"
    assert read_env({**BASE, "INPROCESS_JOB_ID": "j", "SLURM_STEP_ID": "1"}).job_id == "j"


def test_each_round_of_the_launcher_gets_its_own_namespace() -> None:
    control = JobControl.__new__(JobControl)  # the env helper needs no store
    control._backend = EtcdRounds(url=URL, job_id="j1", node_rank=0, port=None, node_timeout=5.0)
    control._sealer = None  # no key: this test is about the namespaces
    assert control.round_store_env(0) == {
        "INPROCESS_STORE": "etcd://10.0.0.1:2379,10.0.0.2:2379,[::1]:2380",
        "INPROCESS_JOB_ID": "j1",
    }
    assert control.round_store_env(2)["INPROCESS_JOB_ID"] == "j1/round2"
    # The URL's path names the job: rounds nest under it.
    control._backend = EtcdRounds(
        url=URL + "/in-url", job_id="j1", node_rank=0, port=None, node_timeout=5.0
    )
    assert control.round_store_env(1)["INPROCESS_JOB_ID"] == "in-url/round1"
    assert parse_url(control.round_store_env(1)["INPROCESS_STORE"]).prefix is None
    control._backend = TcpRounds(node_rank=0, addr="127.0.0.1", port=None, node_timeout=5.0)
    assert control.round_store_env(1) == {}
    # With the job's key, each round's ranks get a key of their own, never the job's.
    control._sealer = Sealer(bytes(range(32)))
    keys = {control.round_store_env(k)[SECRET_ENV] for k in (0, 1)}
    assert len(keys) == 2 and bytes(range(32)).hex() not in keys


@pytest.mark.parametrize("bad", ["team/exp1", "x/round1", "", "a b"])
def test_a_job_id_never_lies_under_another_jobs_namespace(bad: str) -> None:
    """Job ids with '/' let job 'team' delete the keys of a running 'team/exp1', and a user's
    'x/round1' meet the launcher's round 1 of job 'x'."""
    from restartable.inprocess.errors import ConfigError
    from restartable.inprocess.etcd.url import check_job_id

    with pytest.raises(ConfigError, match="no '/'"):
        check_job_id(bad, where="--job-id")
    assert check_job_id("x/round1", where="INPROCESS_JOB_ID", round_suffix=True) == "x/round1"
