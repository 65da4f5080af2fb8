"""Control values bound to their launch, round and iteration; evidence behind "done"; counters
and the secret's place in the environment (issue 46; docs/security.md#the-control-store)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from restartable.checkpoint import sealing
from restartable.checkpoint.sealing import ForgedValueError, Sealer, parse_count
from restartable.inprocess.launch.actions import Action
from restartable.inprocess.launch.node_lost import NodeLostError
from restartable.inprocess.launch.rounds import JobControl
from restartable.inprocess.protocol import iteration_end, job_keys, keys
from restartable.inprocess.protocol.sealed_store import SealedStore

ROOT = Sealer(b"s" * 32)  # one secret shared by two launches (RESTARTABLE_SECRET_FILE)


@pytest.fixture
def raw() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


@pytest.fixture
def two_launches() -> Iterator[tuple[JobControl, JobControl]]:
    a = JobControl(node_rank=0, nnodes=1, addr="127.0.0.1", port=None, node_timeout=5.0,
                   sealer=ROOT)  # fmt: skip
    b = JobControl(node_rank=0, nnodes=1, addr="127.0.0.1", port=None, node_timeout=5.0,
                   sealer=ROOT)  # fmt: skip
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def test_an_action_from_an_earlier_launch_with_the_same_secret_is_rejected(
    two_launches: tuple[JobControl, JobControl],
) -> None:
    earlier, later = two_launches
    assert earlier.launch_id != later.launch_id
    earlier.request(0, Action("end", 0, "finished"))
    earlier.publish_end(0)
    for key in ("launch/r0/action", "launch/end"):
        later.store.raw.set(key, earlier.store.raw.get(key))  # replayed byte for byte
    with pytest.raises(NodeLostError, match=r"forged value.*launch/r0/action"):
        later.action(0)
    with pytest.raises(ForgedValueError, match="launch/end"):
        later.store.get("launch/end")


def test_a_value_opens_only_in_its_launch_round_and_iteration(
    two_launches: tuple[JobControl, JobControl],
) -> None:
    earlier, later = two_launches
    end0 = keys.end_key(0)
    sealed = earlier.round_sealer(0).seal(end0, keys.OUTCOME_DONE)  # type: ignore[union-attr]
    assert earlier.round_sealer(0).open(end0, sealed) == b"done"  # type: ignore[union-attr]
    for other, key in [
        (later.round_sealer(0), end0),  # another launch, same secret
        (earlier.round_sealer(1), end0),  # the next round of the same launch
        (earlier.round_sealer(0), keys.end_key(1)),  # the next iteration
    ]:
        with pytest.raises(ForgedValueError, match="MAC"):
            other.open(key, sealed)  # type: ignore[union-attr]


def test_the_ranks_get_their_rounds_key_never_the_jobs_secret(
    two_launches: tuple[JobControl, JobControl],
) -> None:
    earlier, _ = two_launches
    handed = {earlier.round_store_env(k)[sealing.SECRET_ENV] for k in (0, 1)}
    assert len(handed) == 2 and ROOT.secret.hex() not in handed


def test_done_needs_every_active_ranks_token_not_only_the_counter(raw: dist.TCPStore) -> None:
    store = SealedStore(raw, ROOT)
    raw.add("restartable/it0/done/n", 100)  # a stranger inflates the plain counter
    iteration_end.mark_completed(store, 0, active=2)
    assert iteration_end.outcome(store, 0) is None  # one rank finished: not done
    iteration_end.mark_completed(store, 0, active=2)
    assert iteration_end.outcome(store, 0) == keys.OUTCOME_DONE


def test_a_stranger_at_a_plain_or_sealed_key_reads_as_a_named_error(raw: dist.TCPStore) -> None:
    assert parse_count("c", b"12") == 12
    with pytest.raises(ForgedValueError, match=r"'c' holds 'x\\x00'.*not a count"):
        parse_count("c", b"x\x00")
    store = SealedStore(raw, ROOT)
    raw.set(job_keys.ITERATION_KEY, "7")
    with pytest.raises(ForgedValueError, match=job_keys.ITERATION_KEY):
        job_keys.current_iteration(store)
    raw.set(job_keys.STOPPED_ORIGIN_KEY, "application")  # unverifiable: not trusted to end it
    assert job_keys.stop_origin(store) == ""


def test_the_secret_leaves_the_environment_and_children_do_not_see_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sealing, "_taken", None)
    monkeypatch.setenv(sealing.SECRET_ENV, ROOT.secret.hex())
    sealing.take_from_environ()
    assert sealing.SECRET_ENV not in os.environ
    assert sealing.job_secret() == ROOT.secret  # still this process's
    probe = "import os; print('RESTARTABLE_SECRET' in os.environ)"
    seen = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert seen.stdout.strip() == "False"
    assert sealing.child_env({})[sealing.SECRET_ENV] == ROOT.secret.hex()  # ours, explicitly


def test_the_shared_per_user_file_ends_with_its_launch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sealing, "_taken", None)
    env = {"MASTER_ADDR": "h", "MASTER_PORT": "1", "RESTARTABLE_SECRETS_DIR": str(tmp_path / "s")}
    first = sealing.job_secret(env)
    assert len(list((tmp_path / "s").iterdir())) == 1
    sealing.forget_shared_secret(env)  # node 0's launcher, at the end of its launch
    assert list((tmp_path / "s").iterdir()) == []
    assert sealing.job_secret(env) != first  # the next launch on the same address: a new one
    given = tmp_path / "given"
    given.write_text(ROOT.secret.hex())
    sealing.forget_shared_secret({**env, sealing.SECRET_FILE_ENV: str(given)})
    assert given.exists() and len(list((tmp_path / "s").iterdir())) == 1  # not ours to remove


def test_a_shared_secret_file_is_bound_to_the_job_that_reads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # srun / torchrun without our launcher: two jobs that share RESTARTABLE_SECRET_FILE.
    monkeypatch.setattr(sealing, "_taken", None)
    shared = tmp_path / "secret"
    shared.write_text(ROOT.secret.hex())
    shared.chmod(0o600)
    env = {sealing.SECRET_FILE_ENV: str(shared), "SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0"}
    earlier, also_earlier = sealing.job_sealer(env), sealing.job_sealer(dict(env))
    later = sealing.job_sealer({**env, "SLURM_JOB_ID": "8"})
    assert earlier is not None and also_earlier is not None and later is not None
    done = earlier.seal(keys.end_key(0), keys.OUTCOME_DONE)
    assert also_earlier.open(keys.end_key(0), done) == b"done"  # every process of one job
    with pytest.raises(ForgedValueError, match="MAC"):
        later.open(keys.end_key(0), done)
    handed = sealing.job_sealer({sealing.SECRET_ENV: ROOT.secret.hex(), "SLURM_JOB_ID": "8"})
    assert handed is not None and handed.secret == ROOT.secret  # the launcher's key, as is
