"""LocalTier in one process: validation, memory / directory restore, retention, corruption."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from restartable.checkpoint.errors import (
    CheckpointConfigError,
    CheckpointMismatchError,
    CheckpointStorageError,
)
from restartable.checkpoint.local import LocalTier, background, directory
from restartable.checkpoint.local import tier as tier_module
from tests import peak_memory
from tests.no_group import NoGroup


def _tier(local_dir: Path | None, keep: int = 2, algo: str = "atomic") -> LocalTier:
    d = str(local_dir) if local_dir is not None else None
    return LocalTier(local_dir=d, replication_factor=2, algo=algo, keep=keep, group=NoGroup())


def _state(v: float) -> dict[str, Any]:
    return {"w": torch.full((256,), v), "step": int(v)}


def _meta(local_dir: Path, step: int) -> directory.ShardMeta:
    """The record of rank 0's shard of `step` in the directory."""
    (meta,) = [m for m in directory.scan(local_dir) if (m.step, m.owner) == (step, 0)]
    return meta


def _flip_last_byte(local_dir: Path, step: int) -> None:
    meta = _meta(local_dir, step)
    with open(meta.path, "r+b") as f:
        f.seek(directory.DATA_OFFSET + meta.nbytes - 1)
        last = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([last ^ 0x01]))


def _rewrite_record(meta: directory.ShardMeta, record: bytes) -> None:
    with open(meta.path, "r+b") as f:
        f.write(record)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"algo": "fast"}, r"local_algo \('fast'\) must be one of"),
        ({"replication_factor": 0}, r"replication_factor \(0\) must be >= 1"),
        ({"keep": 0}, r"keep \(0\) must be >= 1"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    args: dict[str, Any] = {
        "local_dir": None,
        "replication_factor": 1,
        "algo": "atomic",
        "keep": 1,
        "group": NoGroup(),
    }
    with pytest.raises(CheckpointConfigError, match=match):
        LocalTier(**{**args, **kwargs})


def test_bad_local_dir(tmp_path: Path) -> None:
    # Found by a user: local_dir had to exist while the persistent root was created for him.
    _tier(tmp_path / "missing" / "local").close()
    assert (tmp_path / "missing" / "local").is_dir()
    assert (tmp_path / "missing" / "local").stat().st_mode & 0o777 == 0o700
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointStorageError, match="is not a directory and cannot be created"):
        _tier(tmp_path / "file")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("running as root: permissions are not enforced")
        with pytest.raises(CheckpointStorageError, match="not writable"):
            _tier(ro)
    finally:
        ro.chmod(0o700)


def test_too_small_local_dir_fails_at_first_save(tmp_path: Path, monkeypatch: Any) -> None:
    import shutil

    tier = _tier(tmp_path)
    real = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(directory.shutil, "disk_usage", lambda p: real._replace(free=1000))
    with pytest.raises(CheckpointStorageError, match="is too small"):
        tier.save(1, _state(1.0))
    tier.close()


def test_memory_restore_then_directory_restore(tmp_path: Path) -> None:
    with _tier(tmp_path) as tier:
        for step in (1, 2, 3):
            tier.save(step, _state(float(step)))
        tier.wait()
        state = _state(0.0)
        res = tier.load(state, min_step=None)
        assert res is not None and (res.step, res.tier) == (3, "memory")
        assert torch.equal(state["w"], torch.full((256,), 3.0)) and state["step"] == 3
        # Retention: two steps kept in the directory (memory likewise).
        assert sorted(m.step for m in directory.scan(tmp_path)) == [2, 3]
        assert sorted({s for s, _ in tier._held}) == [2, 3]
    with _tier(tmp_path) as fresh:  # a new process: only the directory is left
        state = _state(0.0)
        res = fresh.load(state, min_step=None)
        assert res is not None and (res.step, res.tier) == (3, "local_dir")
        assert state["step"] == 3
        assert fresh.load(state, min_step=4) is None


def test_saved_values_are_a_snapshot(tmp_path: Path) -> None:
    with _tier(None) as tier:
        state = _state(1.0)
        tier.save(1, state)
        state["w"].fill_(99.0)  # mutate right after save() returns
        tier.wait()
        res = tier.load(state, min_step=None)
        assert res is not None and torch.equal(state["w"], torch.full((256,), 1.0))


def test_scalars_are_a_snapshot_too() -> None:
    with _tier(None) as tier:
        state: dict[str, Any] = {"w": torch.zeros(2), "sched": {"lrs": [0.1, 0.2]}}
        tier.save(1, state)
        state["sched"]["lrs"].append(0.3)  # mutate a list leaf in place after save()
        tier.wait()
        assert tier.load(state, min_step=None) is not None
        assert state["sched"]["lrs"] == [0.1, 0.2]


def test_a_tensor_changed_in_place_is_saved_with_its_new_layout(tmp_path: Path) -> None:
    """The same tensor objects, in a mapping the save's walk memo replays, change dtype
    (``.data =``, as ``module.half()`` does) and shape (``resize_``): the next save packs them
    as they are now, and its header says so."""

    def state() -> dict[str, Any]:
        return {"model": {f"w{i}": torch.full((4,), float(i)) for i in range(10)}, "step": 1}

    live = state()
    with _tier(tmp_path) as tier:
        for step in (1, 2):  # the second save replays the model from the memo
            tier.save(step, live)
        model = live["model"]
        model["w3"].data = torch.full((4,), 3.5, dtype=torch.float64)
        model["w5"].resize_(6).fill_(5.5)
        tier.save(3, live)
        tier.wait()
        changed = state()
        changed["model"]["w3"] = torch.zeros(4, dtype=torch.float64)
        changed["model"]["w5"] = torch.zeros(6)
        res = tier.load(changed, min_step=3)
        assert res is not None and res.tier == "memory"
        assert torch.equal(changed["model"]["w3"], torch.full((4,), 3.5, dtype=torch.float64))
        assert torch.equal(changed["model"]["w5"], torch.full((6,), 5.5))
        with pytest.raises(CheckpointMismatchError, match=r"w3.*w5"):
            tier.load(state(), min_step=3)  # the old layout no longer matches
    with _tier(tmp_path) as fresh:  # the directory's copy has the new layout too
        changed = state()
        changed["model"]["w3"] = torch.zeros(4, dtype=torch.float64)
        changed["model"]["w5"] = torch.zeros(6)
        res = fresh.load(changed, min_step=3)
        assert res is not None and res.tier == "local_dir"
        assert torch.equal(changed["model"]["w5"], torch.full((6,), 5.5))


def test_corrupt_directory_copy_is_not_loaded(tmp_path: Path) -> None:
    with _tier(tmp_path) as tier:
        tier.save(1, _state(1.0))
        tier.save(2, _state(2.0))
    _flip_last_byte(tmp_path, step=2)
    with _tier(tmp_path) as fresh:
        state = _state(0.0)
        res = fresh.load(state, min_step=None)
        assert res is not None and res.step == 1 and state["step"] == 1
        assert fresh.load(state, min_step=2) is None


def test_corrupt_directory_copy_read_in_place_is_overwritten(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """With a persistent checkpoint to fall back on (min_step set), a directory copy is read
    straight into the state's tensors; one that then fails its checksum must leave nothing of
    itself behind once the older step is restored."""
    from restartable.checkpoint.local import parts

    monkeypatch.setattr(parts, "DIRECT_MIN", 256)  # "w" (1 KiB) is read in place
    with _tier(tmp_path) as tier:
        tier.save(1, _state(1.0))
        tier.save(2, _state(2.0))
    _flip_last_byte(tmp_path, step=2)  # inside "w", the last tensor
    with _tier(tmp_path) as fresh:
        state = _state(0.0)
        res = fresh.load(state, min_step=1)
        assert res is not None and (res.step, res.tier) == (1, "local_dir")
        assert torch.equal(state["w"], torch.full((256,), 1.0)) and state["step"] == 1


@pytest.mark.parametrize("size", [0, 10, 200], ids=["empty", "shorter_than_prefix", "garbage"])
def test_directory_copy_that_is_not_a_shard_is_skipped(tmp_path: Path, size: int) -> None:
    """A shard's bytes replaced by something else (truncated to nothing, a few bytes, garbage)
    under its record, with a persistent checkpoint present (the in-place path reads the header
    first): older step."""
    with _tier(tmp_path) as tier:
        tier.save(1, _state(1.0))
        tier.save(2, _state(2.0))
    path = _meta(tmp_path, step=2).path
    with open(path, "r+b") as f:
        f.truncate(directory.DATA_OFFSET)
        f.seek(directory.DATA_OFFSET)
        f.write(b"\x07" * size)
    with _tier(tmp_path) as fresh:
        state = _state(0.0)
        res = fresh.load(state, min_step=1)
        assert res is not None and res.step == 1 and state["step"] == 1


@pytest.mark.skipif(not peak_memory.AVAILABLE, reason="needs Linux /proc")
def test_directory_restore_into_state_needs_no_second_copy(tmp_path: Path) -> None:
    """A 64 MiB shard read from the directory lands in the state's own tensor when a persistent
    checkpoint exists: the peak memory grows by far less than the shard; without one, the shard
    is read and verified in a buffer of its own first."""
    import gc

    n = 16 << 20  # float32s
    with _tier(tmp_path) as tier:
        tier.save(1, {"w": torch.full((n,), 3.0), "step": 1})
    growth = {}
    for min_step in (None, 1):
        with _tier(tmp_path) as fresh:
            state = {"w": torch.zeros(n), "step": 0}  # in memory already, as a model is
            gc.collect()
            res, growth[min_step] = peak_memory.growth_mib(
                lambda: fresh.load(state, min_step=min_step)  # noqa: B023 (called at once)
            )
            assert res is not None and res.tier == "local_dir" and bool((state["w"] == 3).all())
    assert growth[None] > 60, growth  # the shard's own buffer
    assert growth[1] < 16, growth


def test_shard_with_another_checksum_algorithm_is_ignored(tmp_path: Path) -> None:
    """Metadata from a version that used another checksum cannot verify its shard: skipped."""
    with _tier(tmp_path) as tier:
        tier.save(1, _state(1.0))
        tier.save(2, _state(2.0))
    meta = _meta(tmp_path, step=2)
    _rewrite_record(meta, directory.encode_record(meta, algo="crc32"))
    with _tier(tmp_path) as fresh:
        state = _state(0.0)
        res = fresh.load(state, min_step=None)
        assert res is not None and res.step == 1 and state["step"] == 1


def test_buffers_are_reused(tmp_path: Path) -> None:
    with _tier(None, keep=1) as tier:
        seen = set()
        for step in range(1, 8):
            tier.save(step, _state(float(step)))
            tier.wait()
            seen |= {s.buf.data_ptr() for s in tier._held.values()}
        assert len(seen) <= 2


def test_close_is_idempotent_and_final() -> None:
    tier = _tier(None)
    tier.close()
    tier.close()
    with pytest.raises(Exception, match="after close"):
        tier.save(1, _state(1.0))


def test_other_world_size_is_not_served(tmp_path: Path) -> None:
    import dataclasses

    with _tier(tmp_path) as tier:
        tier.save(1, _state(1.0))
    meta = _meta(tmp_path, step=1)
    # As if saved by a 2-rank job.
    _rewrite_record(meta, directory.encode_record(dataclasses.replace(meta, world=2)))
    with _tier(tmp_path) as fresh:
        assert fresh.load(_state(0.0), min_step=None) is None  # the persistent tier reshards


def test_rewind_forgets_the_abandoned_steps() -> None:
    with _tier(None, keep=3) as tier:
        for step in (1, 2, 3):
            tier.save(step, _state(float(step)))
        tier.save(2, _state(20.0))  # training went back to step 1 and saves step 2 again
        tier.wait()
        state = _state(0.0)
        res = tier.load(state, min_step=None)
        assert res is not None and res.step == 2 and state["step"] == 20


@pytest.mark.parametrize(
    ("usable", "cpus", "local_world_size", "spare"),
    [
        (2, 2, "2", False),  # every core has a rank: this project's 2-rank benchmark
        (2, 2, "3", False),  # and with a reserve
        (16, 16, "8", True),  # a GPU node: more cores than ranks
        (2, 2, None, True),  # one process alone
        (2, 2, "junk", True),  # unreadable: taken as one rank
        (1, 16, "8", False),  # bound to one CPU (srun --cpu-bind): it has only that one
        (4, 16, "8", True),  # bound to four CPUs of its own
    ],
)
def test_spare_core_counts_the_cores_a_rank_has_to_itself(
    monkeypatch: Any, usable: int, cpus: int, local_world_size: str | None, spare: bool
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(usable)), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: cpus)
    env = {} if local_world_size is None else {"LOCAL_WORLD_SIZE": local_world_size}
    assert background.spare_core(env) is spare


@pytest.mark.parametrize("spare", [True, False])
def test_the_directory_write_runs_on_the_training_thread_only_without_a_spare_core(
    tmp_path: Path, monkeypatch: Any, spare: bool
) -> None:
    """With a spare core the node-local file is written behind save(); without one, within it
    (a background thread would take its CPU from a training rank), and it is on disk when save()
    returns. Either way the directory then restores the step."""
    monkeypatch.setattr(tier_module, "spare_core", lambda: spare)
    writers: list[str] = []
    real_write = directory.ShardFiles.write

    def write(self: directory.ShardFiles, *args: Any) -> None:
        writers.append(threading.current_thread().name)
        real_write(self, *args)

    monkeypatch.setattr(directory.ShardFiles, "write", write)
    with _tier(tmp_path) as tier:
        for step in (1, 2):
            tier.save(step, _state(float(step)))
            if not spare:
                assert _meta(tmp_path, step).step == step  # before any wait()
        tier.wait()
    assert writers == (["local-ckpt"] * 2 if spare else [threading.main_thread().name] * 2)
    with _tier(tmp_path) as fresh:
        state = _state(0.0)
        res = fresh.load(state, min_step=None)
        assert res is not None and (res.step, res.tier) == (2, "local_dir") and state["step"] == 2
