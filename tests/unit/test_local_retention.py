"""The local tier's retention with a batched agreement (checkpoint.local.holdings), its cadence,
and the training thread's cheap forms (bytes leaves without torch.save)."""

from __future__ import annotations

import base64
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from restartable.checkpoint.local import LocalTier, directory, packing, unpacking, walk
from restartable.checkpoint.local import peers as peers_mod
from restartable.checkpoint.local.holdings import Holdings
from restartable.checkpoint.local.restore import Shard
from tests.no_group import NoGroup


def _shard(h: Holdings, step: int, owner: int = 0) -> Shard:
    return Shard(step, owner, 2, 8, None, h.take(8))


def _steps(h: Holdings) -> list[int]:
    return sorted({s for s, _ in h.held})


def test_keeps_the_confirmed_steps_and_the_two_newest_saved_since() -> None:
    h = Holdings(keep=2)
    h.add_own(_shard(h, 1))
    h.mark_ok(1)
    h.confirm(1)  # the agreement of the first save
    for step in range(2, 7):  # no agreement in between: only the newest two survive
        h.add_own(_shard(h, step))
        h.add_replica(_shard(h, step, owner=1))
        h.mark_ok(step)
    assert _steps(h) == [1, 5, 6]
    assert h.offered() == [5, 6]
    # The next agreement confirms the newest step every rank offered; older ones are freed.
    h.confirm(6)
    assert _steps(h) == [1, 6]
    h.add_own(_shard(h, 7))
    h.confirm(7)
    h.add_own(_shard(h, 8))
    h.confirm(8)
    assert _steps(h) == [7, 8]  # keep = 2 confirmed steps
    assert h.disk_kept() == ({7, 8}, 9)


def test_a_step_that_failed_here_is_not_offered_and_an_older_one_is_confirmed() -> None:
    # The documented rule: when the newest step's background work failed on some rank, the
    # agreement confirms the one before it (offered by every rank); a restore after a process
    # death then goes back to it, not to the newest step.
    h = Holdings(keep=1)
    for step in (1, 2):
        h.add_own(_shard(h, step))
    h.mark_ok(1)  # step 2 failed here (its file or a replica)
    assert h.offered() == [1]
    h.confirm(1)
    assert _steps(h) == [1, 2]  # step 2 stays until a newer one is confirmed or pushes it out
    h.add_own(_shard(h, 3))
    h.add_own(_shard(h, 4))
    assert _steps(h) == [1, 3, 4]


def test_buffers_are_reused_across_evictions() -> None:
    h = Holdings(keep=1)
    seen = set()
    h.add_own(_shard(h, 0))
    h.confirm(0)
    for step in range(1, 12):
        h.make_room()  # as save() does before it takes its buffer
        sh = _shard(h, step)
        seen.add(sh.buf.data_ptr())
        h.add_own(sh)
        assert len(h.held) <= 3  # keep (1) confirmed + the two newest
    assert len(seen) <= 2  # the recent steps' buffers alternate


def test_the_store_agreement_runs_on_the_first_and_every_nth_save(monkeypatch: Any) -> None:
    group = NoGroup(token="t")
    tier = LocalTier(local_dir=None, replication_factor=1, algo="atomic", keep=2, group=group)
    calls: list[int] = []
    monkeypatch.setattr(peers_mod.dist, "get_world_size", lambda pg: 2)
    monkeypatch.setattr(
        tier._peers._attempts, "next", lambda pg, token: calls.append(1) or ("x", None)
    )
    pg: Any = object()
    agreed = [
        tier._peers.next_agreement(pg) is not None for _ in range(2 * peers_mod.AGREE_EVERY + 1)
    ]
    n = peers_mod.AGREE_EVERY
    assert [i for i, a in enumerate(agreed) if a] == [0, n, 2 * n]
    group.token = "new"  # a new group (a restart): the count starts again, on every rank
    assert tier._peers.next_agreement(pg) is not None
    tier.close()


@pytest.mark.parametrize("payload", [b"", b"\x00\x01rng-state" * 100])
def test_bytes_leaves_are_plain_base64_in_the_header(payload: bytes) -> None:
    leaves = walk.leaves({"rng": payload, "w": torch.ones(2)}, [])
    obj = next(x.value for x in leaves if x.key == "rng")
    assert obj == {"__restartable_bytes__": base64.b64encode(payload).decode()}
    layout = packing.ShardLayout.of([x for x in leaves if x.key == "w"])
    header = packing.header_bytes(layout, {"rng": obj}, {"step": 1})
    buf = torch.zeros(packing.packed_size(layout, header), dtype=torch.uint8)
    packing.pack_into(buf, layout, header, [x.value for x in leaves if x.key == "w"])
    state: dict[str, Any] = {"rng": b"old", "w": torch.zeros(2)}
    unpacking.unpack_into(buf, state)
    assert state["rng"] == payload and type(state["rng"]) is bytes


def test_directory_files_of_pruned_steps_are_overwritten_not_recreated(tmp_path: Path) -> None:
    # A pruned step's file is reused for a later step (its pages are in the page cache); the
    # directory still holds only the kept steps' shards, and a new process restores from it.
    group = NoGroup()
    with LocalTier(
        local_dir=str(tmp_path), replication_factor=1, algo="atomic", keep=1, group=group
    ) as tier:
        inodes = []
        for step in range(1, 7):
            tier.save(step, {"w": torch.full((4096,), float(step)), "step": step})
            tier.wait()
            (meta,) = [m for m in directory.scan(tmp_path) if m.step == step]
            inodes.append(os.stat(meta.path).st_ino)
        assert len(set(inodes)) <= 3  # files were reused: keep + the two newest at most
        assert [m.step for m in directory.scan(tmp_path)] == [6]
    with LocalTier(
        local_dir=str(tmp_path), replication_factor=1, algo="atomic", keep=1, group=group
    ) as fresh:
        state: dict[str, Any] = {"w": torch.zeros(4096), "step": 0}
        res = fresh.load(state, min_step=None)
        assert res is not None and (res.step, res.tier) == (6, "local_dir")
        assert torch.equal(state["w"], torch.full((4096,), 6.0)) and state["step"] == 6
