"""The local tier restored onto a smaller world: the old world's shards, resharded by key."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from restartable.checkpoint.local import directory, integrity, packing, walk
from restartable.checkpoint.local.reshard import restore_resharded
from restartable.checkpoint.local.restore import Shard, restore


def _shard(state: dict[str, Any], *, step: int, owner: int, world: int, keep: set[str]) -> Shard:
    """Pack ``state`` as LocalTier.save does on rank ``owner`` of ``world`` (tensors in ``keep``
    only: fully_parallel splits the replicated ones among the owners)."""
    leaves = walk.leaves(state, [])
    tensors = [x for x in leaves if isinstance(x.value, torch.Tensor) and x.key in keep]
    objects = {x.key: x.value for x in leaves if not isinstance(x.value, torch.Tensor)}
    layout = packing.ShardLayout.of(tensors)
    extra = {"step": step, "owner": owner, "world": world, "algo": "fully_parallel"}
    header = packing.header_bytes(layout, objects, extra)
    buf = torch.empty(packing.packed_size(layout, header), dtype=torch.uint8)
    nbytes = packing.pack_into(buf, layout, header, [x.value for x in tensors])
    return Shard(step, owner, world, nbytes, integrity.of(buf, nbytes), buf)


def _old_world(step: int) -> list[Shard]:
    # Two ranks of a data-parallel job: the weight kept by owner 0, the bias by owner 1 (as
    # fully_parallel splits them), and a per-rank value under a per-rank key on each.
    shards = []
    for owner in range(2):
        state = {
            "model": {"w": torch.full((3,), float(step)), "b": torch.full((2,), step + 0.5)},
            f"rerun_rank{owner}": {"seen": owner * 10 + step},
            "step": step,
        }
        keep = {"model/w"} if owner == 0 else {"model/b"}
        shards.append(_shard(state, step=step, owner=owner, world=2, keep=keep))
    return shards


def _target() -> dict[str, Any]:
    return {
        "model": {"w": torch.zeros(3), "b": torch.zeros(2)},
        "rerun_rank0": {"seen": -1},
        "step": 0,
    }


def test_a_shrunk_world_restores_the_newest_step_from_the_node_directory(tmp_path: Path) -> None:
    files = directory.ShardFiles(tmp_path)
    for step in (99, 100):
        for sh in _old_world(step):
            files.write(sh.meta(), sh.buf)
    files.close()
    state = _target()
    got = restore_resharded(
        state, pg=None, rank=0, world=1, held=[], local_dir=tmp_path, min_step=50
    )
    assert got is not None and (got.step, got.tier) == (100, "local_dir")
    assert torch.equal(state["model"]["w"], torch.full((3,), 100.0))
    assert torch.equal(state["model"]["b"], torch.full((2,), 100.5))  # from owner 1's shard
    assert state["rerun_rank0"] == {"seen": 100} and state["step"] == 100


def test_memory_copies_serve_and_a_missing_or_corrupt_shard_means_none(tmp_path: Path) -> None:
    held = _old_world(100)
    state = _target()
    got = restore_resharded(state, pg=None, rank=0, world=1, held=held, local_dir=None,
                            min_step=None)  # fmt: skip
    assert got is not None and got.tier == "memory" and state["step"] == 100
    # Only owner 0's shard: the bias is nowhere.
    assert restore_resharded(_target(), pg=None, rank=0, world=1, held=held[:1],
                             local_dir=None, min_step=None) is None  # fmt: skip
    # A corrupt file is not loaded; a step older than the persistent tier's is not wanted.
    files = directory.ShardFiles(tmp_path)
    for sh in held:
        files.write(sh.meta(), sh.buf)
    files.close()
    (meta,) = [m for m in directory.scan(tmp_path) if m.owner == 1]
    with open(meta.path, "r+b") as f:
        f.seek(directory.DATA_OFFSET + meta.nbytes - 1)
        last = f.read(1)[0]
        f.seek(-1, 1)
        f.write(bytes([last ^ 0xFF]))
    assert restore_resharded(_target(), pg=None, rank=0, world=1, held=[], local_dir=tmp_path,
                             min_step=None) is None  # fmt: skip
    assert restore_resharded(_target(), pg=None, rank=0, world=1, held=held, local_dir=None,
                             min_step=101) is None  # fmt: skip


def test_the_same_world_is_not_resharded(tmp_path: Path) -> None:
    # Shards of the current world size are the same-world restore's (checkpoint.local.restore).
    held = _old_world(100)
    assert restore_resharded(_target(), pg=None, rank=0, world=2, held=held, local_dir=None,
                             min_step=None) is None  # fmt: skip


def test_the_same_world_restore_does_not_say_none_without_a_persistent_step(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The rank logs said "local tier: no step >= None that every one of 3 ranks can obtain".
    with caplog.at_level(logging.INFO, logger="restartable.checkpoint.local.restore"):
        got = restore(_target(), pg=None, rank=0, world=1, held={}, local_dir=None,
                      min_step=None, replicated_owner=None)  # fmt: skip
    assert got is None and "no step that every one of 1 ranks" in caplog.text
    assert "None" not in caplog.text
