"""Sealed store values, the plain-data codec and the job secret (docs/security.md)."""

from __future__ import annotations

import datetime
import os
import pickle
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import DefaultSavePlanner

from restartable.checkpoint import plain
from restartable.checkpoint.errors import CheckpointError
from restartable.checkpoint.exchange import StoreExchange
from restartable.checkpoint.sealing import ForgedValueError, Sealer, job_secret
from restartable.inprocess.clock import Clock
from restartable.inprocess.errors import FaultRecord
from restartable.inprocess.launch.node_lost import NodeLostError
from restartable.inprocess.launch.rounds import JobControl
from restartable.inprocess.protocol import fault_records, iteration_end, keys
from restartable.inprocess.protocol.sealed_store import SealedStore

SEALER = Sealer(b"k" * 32)


class _Boom:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, ("exit 3",))


@pytest.fixture
def raw() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def test_a_value_opens_under_its_own_key_only() -> None:
    sealed = SEALER.seal("a", b"fault")
    assert SEALER.open("a", sealed) == b"fault"
    with pytest.raises(ForgedValueError, match=r"'b'.*MAC"):
        SEALER.open("b", sealed)  # copied to another key
    with pytest.raises(ForgedValueError, match="MAC"):
        Sealer(b"x" * 32).open("a", sealed)  # another job's secret
    with pytest.raises(ForgedValueError, match="not written by this job"):
        SEALER.open("a", b'{"kind": "end", "status": 0}')
    with pytest.raises(ForgedValueError, match="truncated"):
        SEALER.open("a", sealed[:10])


def test_appended_frames_open_together() -> None:
    value = SEALER.seal("f", "one\n") + SEALER.seal("f", "two\n")
    assert SEALER.open("f", value) == b"one\ntwo\n"
    with pytest.raises(ForgedValueError):
        SEALER.open("f", value + b"three\n")  # a stranger's append


def test_sealed_store_keeps_the_protocol_and_rejects_forgeries(
    raw: dist.TCPStore, caplog: pytest.LogCaptureFixture
) -> None:
    store = SealedStore(raw, SEALER)
    record = FaultRecord(iteration=0, initial_rank=1, kind="exception", detail="x", step=3)
    fault_records.record_fault(store, record)
    assert iteration_end.outcome(store, 0) == keys.OUTCOME_FAULT
    assert [f.kind for f in fault_records.read_faults(store, 0)] == ["exception"]
    assert store.compare_set("c", "", "mine") == b"mine"
    assert store.compare_set("c", "", "theirs") == b"mine"  # first writer wins, as before
    assert store.compare_set("c", "mine", "next") == b"next"
    raw.set("c2", "forged")  # an answer that is not this call's own frame is verified
    with pytest.raises(ForgedValueError, match="'c2'"):
        store.compare_set("c2", "", "mine")
    # A stranger's "done" (or anything unverifiable) at an iteration's end is a fault of that
    # iteration, named in the log: never success, never a reader that stops watching.
    raw.set(keys.end_key(1), "done")
    assert iteration_end.outcome(store, 1) == keys.OUTCOME_FAULT
    assert keys.end_key(1) in caplog.text and "rejected unread" in caplog.text
    raw.set(keys.end_key(2), pickle.dumps(_Boom()))
    assert (
        iteration_end.wait_outcome(store, 2, timeout=1.0, clock=Clock(monotonic=lambda: 0.0))
        == keys.OUTCOME_FAULT
    )


def test_a_forged_launcher_action_stops_the_job_instead_of_ending_it(tmp_path: Path) -> None:
    control = JobControl(
        node_rank=0, nnodes=1, addr="127.0.0.1", port=None, node_timeout=5.0, sealer=SEALER
    )
    try:
        raw = control.store.raw
        raw.set(control._k("r0/action"), '{"kind": "end", "status": 0, "reason": "forged"}')
        with pytest.raises(NodeLostError, match=r"forged value.*r0/action"):
            control.action(0)
    finally:
        control.close()


def test_the_save_exchange_is_plain_sealed_data(raw: dist.TCPStore) -> None:
    def ex(rank: int) -> StoreExchange:
        return StoreExchange(
            raw, "ns", rank=rank, world=2, cancel=threading.Event(), timeout=5.0, sealer=SEALER
        )

    one = ex(1)
    one.gather("plan", ("err", b"\x00bytes", {"k": (1, 2)}))
    assert ex(0).gather("plan", None) == [None, ("err", b"\x00bytes", {"k": (1, 2)})]
    raw.set("ns/start", pickle.dumps(_Boom()))
    with pytest.raises(CheckpointError, match=r"'ns/start'.*rejected unread"):
        one.receive("start")


def test_plain_codec_round_trips_dcp_plans_and_refuses_the_rest() -> None:
    planner = DefaultSavePlanner()
    planner.set_up_planner(state_dict={"w": torch.ones(3), "o": {"x": [1, 2]}}, is_coordinator=True)
    plan = planner.create_local_plan()
    assert plain.loads(plain.dumps(plan)) == plan
    with pytest.raises(plain.PlainDataError, match="not plain data"):
        plain.dumps(_Boom())
    crafted = b'{"__p": "dc", "c": "Popen", "v": {}}'
    with pytest.raises(plain.PlainDataError, match="not one of the plan classes"):
        plain.loads(crafted)
    with pytest.raises(plain.PlainDataError):
        plain.loads(pickle.dumps(_Boom()))


def test_first_process_makes_the_secret_the_others_read_it(tmp_path: Path) -> None:
    env = {"MASTER_ADDR": "h", "MASTER_PORT": "1", "RESTARTABLE_SECRETS_DIR": str(tmp_path / "s")}
    first = job_secret(env)
    assert first is not None and len(first) == 32
    assert job_secret(env, create=False) == first
    (only,) = (tmp_path / "s").iterdir()
    assert (tmp_path / "s").stat().st_mode & 0o777 == 0o700
    assert only.stat().st_mode & 0o777 == 0o600
    only.chmod(0o644)
    with pytest.raises(PermissionError, match="mode 0600"):
        job_secret(env)
    only.chmod(0o600)
    assert job_secret({**env, "MASTER_PORT": "2"}) != first  # another job
    assert job_secret({}) is None  # no job: nothing to authenticate


def test_wait_timeout_is_not_a_forgery(raw: dist.TCPStore) -> None:
    store = SealedStore(raw, SEALER)
    with pytest.raises(Exception, match=r"(?i)timeout"):
        store.wait(["never"], datetime.timedelta(milliseconds=50))
