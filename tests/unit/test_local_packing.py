"""Flat-buffer packing of the local tier: round trip, in-place fill, mismatches, checksum."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from restartable.checkpoint.errors import CheckpointError, CheckpointMismatchError
from restartable.checkpoint.local import packing, unpacking, walk
from restartable.checkpoint.local.leaf import ReplicatedState


def _pack(state: dict[str, Any]) -> torch.Tensor:
    sf: list[Any] = []
    lv = walk.leaves(state, sf)
    tensors = [x for x in lv if isinstance(x.value, torch.Tensor)]
    objects = {x.key: x.value for x in lv if not isinstance(x.value, torch.Tensor)}
    layout = packing.ShardLayout.of(tensors)
    header = packing.header_bytes(layout, objects, {"step": 1})
    buf = torch.empty(packing.packed_size(layout, header), dtype=torch.uint8)
    packing.pack_into(buf, layout, header, [x.value for x in tensors])
    return buf


def _state() -> dict[str, Any]:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    return {
        "model": model,
        "opt": opt,
        "x": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)[:, 1:],  # non-contiguous view
        "flags": torch.tensor([True, False]),
        "empty": torch.empty(0),
        "step": 7,
        "sched": {"lr": [0.1, 0.01], "name": "cos", "pair": (1, 2)},
    }


def test_round_trip_fills_in_place() -> None:
    src = _state()
    buf = _pack(src)
    dst = _state()
    x = dst["x"]
    with torch.no_grad():
        for p in dst["model"].parameters():
            p.zero_()
    dst["x"].zero_()
    dst["step"] = 0
    dst["sched"]["pair"] = (0, 0)
    unpacking.unpack_into(buf, dst)
    assert dst["x"] is x and torch.equal(x, src["x"])
    for a, b in zip(src["model"].parameters(), dst["model"].parameters(), strict=True):
        assert torch.equal(a, b)
    sa, sb = src["opt"].state_dict()["state"], dst["opt"].state_dict()["state"]
    assert all(torch.equal(sa[k]["exp_avg"], sb[k]["exp_avg"]) for k in sa)
    assert dst["step"] == 7 and dst["sched"] == {"lr": [0.1, 0.01], "name": "cos", "pair": (1, 2)}


def test_mismatch_lists_every_bad_key() -> None:
    buf = _pack({"a": torch.zeros(3), "b": torch.zeros(2), "n": 1})
    with pytest.raises(CheckpointMismatchError) as e:
        unpacking.unpack_into(buf, {"a": torch.zeros(4), "b": torch.zeros(2), "c": torch.zeros(1)})
    assert e.value.keys == ["a", "c"]
    assert "a (saved float32[3]" in str(e.value)


def test_unsupported_leaf_names_the_key() -> None:
    with pytest.raises(CheckpointError, match=r"'cfg/fn' has type function"):
        _pack({"cfg": {"fn": lambda: 0}})


def test_bytes_and_picklable_objects_round_trip() -> None:
    # DCP accepts any picklable leaf (RNG states are bytes); the local tier must too.
    saved = {"rng": b"\x00\xffstate", "cfg": {"when": (1, "a")}, "s": {3, 4}}
    buf = _pack(saved)
    target = {"rng": b"", "cfg": {"when": (0, "")}, "s": set()}
    unpacking.unpack_into(buf, target)
    assert target == saved


def test_not_a_shard() -> None:
    with pytest.raises(CheckpointError, match="not a local-tier shard"):
        packing.parse(torch.zeros(64, dtype=torch.uint8))


def test_corrupt_header_is_a_checkpoint_error() -> None:
    """A peer sending a replica parses its header first: garbage there must not escape as a
    JSON or unpacking error."""
    buf = _pack({"w": torch.randn(10)})
    start = packing._PREFIX.size
    buf[start : start + 4] = torch.tensor(list(b"@@@@"), dtype=torch.uint8)
    with pytest.raises(CheckpointError, match="header does not decode"):
        packing.parse(buf)


def test_replicated_marker_reaches_the_leaves() -> None:
    state = {"m": ReplicatedState({"w": torch.ones(2)}), "r": torch.ones(1)}
    flags = {x.key: x.replicated for x in walk.leaves(state, [])}
    assert flags == {"m/w": True, "r": False}


def test_reused_buffer_with_a_longer_header_packs_correctly() -> None:
    """A local save reuses its buffer and layout from step to step while the header (scalars,
    pickled objects) changes length: the data must move with it."""
    state = {"w": torch.randn(1000), "b": torch.arange(5, dtype=torch.int64)}
    lv = walk.leaves(state, [])
    tensors = [x for x in lv if isinstance(x.value, torch.Tensor)]
    layout = packing.ShardLayout.of(tensors)
    buf = torch.empty(1 << 16, dtype=torch.uint8)
    for note in ("short", "a much longer note " * 20, "short again"):
        state["w"].add_(1.0)
        header = packing.header_bytes(layout, {"note": note}, {"step": 1})
        packing.pack_into(buf, layout, header, [x.value for x in tensors])
        target = {"w": torch.zeros(1000), "b": torch.zeros(5, dtype=torch.int64)}
        unpacking.fill_leaves(buf, walk.leaves(target, []), keep=lambda k: k != "note")
        assert torch.equal(target["w"], state["w"]) and torch.equal(target["b"], state["b"])
