"""What the node path's rank side costs (issue 52, docs/scale.md "the node path"): the published
assignment decoded only as far as a released rank needs it, a death report that counts nothing
on the job store where the ranks meet by node, and the torch-free client's wait for a value
(what a rank's node-store client does) in two round trips."""

from __future__ import annotations

import datetime
import pickle
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from restartable.inprocess.config import RestartConfig
from restartable.inprocess.errors import FaultRecord
from restartable.inprocess.protocol import fault_records, job_keys
from restartable.inprocess.protocol.policy import Decision, Observed, decide
from restartable.inprocess.protocol.rank_runs import EncodedAssignment
from restartable.inprocess.protocol.ranks import Assignment, encode_ranks, reassign
from restartable.inprocess.protocol.store import C10dStore, StoreBase
from restartable.inprocess.protocol.tcpstore_client import _GET, _WAIT, TCPStoreClient


def _plain(active: tuple[int, ...], reserve: tuple[int, ...], retired: set[int]) -> Assignment:
    return Assignment(active=active, reserve=reserve, retired=frozenset(retired))


def test_an_encoded_assignment_answers_a_rank_without_decoding_and_equals_the_plain_one() -> None:
    active, reserve = (0, 2, 3, 4, 9, 5), (6, 7)
    enc = EncodedAssignment(encode_ranks(active), encode_ranks(reserve), "1,8")
    assert [enc.rank_of(r) for r in (0, 2, 4, 9, 5, 1, 6, 100)] == [0, 1, 3, 4, 5, None, None, None]
    assert enc.world_size == 6
    assert "active" not in vars(enc)  # answered from the runs
    plain = _plain(active, reserve, {1, 8})
    assert enc == plain and plain == enc and hash(enc) == hash(plain)
    assert (enc.active, enc.reserve, enc.retired) == (active, reserve, frozenset({1, 8}))
    assert [enc.rank_of(r) for r in (9, 1)] == [4, None]  # the decoded form answers alike
    back = pickle.loads(pickle.dumps(EncodedAssignment("0-3", "", "")))
    assert type(back) is Assignment and back == _plain((0, 1, 2, 3), (), set())


@pytest.mark.parametrize("bad", ["0-x", "5-3", "a"])
def test_a_malformed_published_rank_list_is_refused_when_read(bad: str) -> None:
    with pytest.raises(ValueError, match="rank list"):
        EncodedAssignment(bad, "", "")
    with pytest.raises(ValueError, match="rank list"):
        EncodedAssignment("0-3", bad, "")


def test_a_published_decision_reads_back_equal_with_its_assignment_encoded() -> None:
    nodes = [r // 4 for r in range(64)]
    before = _plain(tuple(range(60)), tuple(range(60, 64)), set())
    fault = FaultRecord(iteration=0, initial_rank=5, kind="dead", detail="SIGKILL")
    decision = decide(
        Observed(iteration=0, faults=(fault,), gone=frozenset({5})),
        history=[],
        assignment=before,
        target=60,
        node_of=nodes,
        config=RestartConfig(),
    )
    read = Decision.from_json(decision.to_json())
    assert isinstance(read.assignment, EncodedAssignment)
    assert read == decision
    expected = reassign(
        before,
        node_of=nodes,
        lost={5},
        granularity="rank",
        active_world_size=60,
        min_active_world_size=1,
    )
    assert read.assignment == expected and read.assignment.rank_of(60) == 5


class Logged(StoreBase):
    """A c10d store's calls, named in order (the generic fast paths count call by call)."""

    def __init__(self, raw: dist.Store) -> None:
        self.inner, self.log = C10dStore(raw), list[str]()

    def __getattr__(self, name: str) -> object:
        fn = getattr(self.inner, name)

        def call(*args: object) -> object:
            self.log.append(name)
            return fn(*args)

        return call

    # StoreBase defines these; route them through the log as the c10d calls they are.
    def set(self, key: str, value: str | bytes) -> None:
        self.log.append("set")
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        self.log.append("get")
        return self.inner.get(key)

    def add(self, key: str, value: int) -> int:
        self.log.append("add")
        return self.inner.add(key, value)

    def append(self, key: str, value: str | bytes) -> None:
        self.log.append("append")
        self.inner.append(key, value)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        self.log.append("compare_set")
        return self.inner.compare_set(key, expected, desired)

    def check(self, keys: list[str]) -> bool:
        self.log.append("check")
        return self.inner.check(keys)


@pytest.mark.parametrize("by_node", [True, False])
def test_a_death_report_counts_the_rank_on_the_job_store_only_on_the_per_rank_path(
    by_node: bool,
) -> None:
    store = Logged(dist.HashStore())
    job_keys.start_iteration(store, 0, participants=4, reserves=(3,), by_node=by_node)
    store.log.clear()
    fault_records.report_fault(store, iteration=0, initial_rank=1, kind="dead", detail="kill")
    counted = ["add", "add"] if not by_node else []
    assert store.log == ["append", "append", "check", "get", *counted, *["compare_set"] * 3]
    assert store.get("restartable/it0/end") == b"fault"
    assert fault_records.read_faults(store, 0)[0].initial_rank == 1


@pytest.fixture
def ours() -> Iterator[TCPStoreClient]:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = TCPStoreClient("127.0.0.1", server.port, timeout=10.0)
    yield client
    client.close()


def test_the_torch_free_clients_wait_value_is_one_wait_and_one_get(ours: TCPStoreClient) -> None:
    ours.set("k", "v")
    sent: list[int] = []
    real = ours._send
    ours._send = lambda data: (sent.append(data[0]), real(data))[1]  # type: ignore[method-assign]
    assert ours.wait_value("k", datetime.timedelta(seconds=5)) == b"v"
    assert ours.get("k") == b"v"
    assert sent == [_WAIT, _GET, _WAIT, _GET]
