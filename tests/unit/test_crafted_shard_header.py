"""A local-tier shard's header is input: a crafted tensor table (its checksum is not keyed, so it
can be fixed up) fails with a ``CheckpointError`` before any byte is viewed, and the keys it
names, ``../`` ones included, are only ever looked up, never used as paths."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from restartable.checkpoint.errors import CheckpointError
from restartable.checkpoint.local import packing, unpacking


def _shard(rows: list[Any], objects: dict[str, Any] | None = None) -> torch.Tensor:
    """A buffer laid out like ``pack_into``'s, with ``rows`` as its tensor table and 64 data
    bytes of 1.0f (so a view that slipped would show in the state)."""
    header = json.dumps(
        {"tensors": rows, "objects": objects or {"n": 1}, "extra": {"step": 1}, "sharding": {}}
    ).encode()
    prefix = packing._PREFIX.pack(packing.MAGIC, len(header)) + header
    start = packing.header_end(prefix[: packing.PREFIX_SIZE])
    buf = torch.zeros(start + 64, dtype=torch.uint8)
    buf[: len(prefix)] = torch.frombuffer(bytearray(prefix), dtype=torch.uint8)
    buf[start:].view(torch.float32).fill_(1.0)
    return buf


@pytest.mark.parametrize(
    ("row", "problem"),
    [
        (["w", "float32", [4], -64, 16], "offset -64"),  # would read the header as data
        (["w", "float32", [4], 10**6, 16], "bytes lie past its end"),
        (["w", "float32", [4], 2**62, 16], "bytes lie past its end"),
        (["w", "float32", [4], 3, 16], "not a multiple of 4"),
        (["w", "float32", [4], "0", 16], "offset '0'"),
        (["w", "float32", [4], 0, 1], "1 bytes, not the 16 of its shape"),
        (["w", "object", [4], 0, 16], "dtype 'object'"),
        (["w", "float32", [-4], 0, 16], "not a list of sizes >= 0"),
        (["w", "float32", [4]], "not [key, dtype, shape, offset, nbytes]"),
    ],
)
def test_a_crafted_tensor_row_is_refused_and_nothing_is_filled(
    row: list[Any], problem: str
) -> None:
    state = {"w": torch.zeros(4), "n": 0}
    with pytest.raises(CheckpointError, match="not a local-tier shard") as info:
        unpacking.unpack_into(_shard([row]), state)
    assert problem in str(info.value)
    assert state["w"].tolist() == [0.0] * 4 and state["n"] == 0


def test_keys_naming_parent_directories_are_only_looked_up() -> None:
    rows = [["../../etc/w", "float32", [4], 0, 16], ["w", "float32", [4], 16, 16]]
    state = {"w": torch.zeros(4), "n": 0}
    unpacking.unpack_into(_shard(rows, {"../n": 5, "n": 2}), state)
    assert state == {"w": state["w"], "n": 2} and state["w"].tolist() == [1.0] * 4


def test_a_well_formed_table_still_loads() -> None:
    state = {"w": torch.zeros(4), "n": 0}
    unpacking.unpack_into(_shard([["w", "float32", [4], 0, 16]]), state)
    assert state["w"].tolist() == [1.0] * 4 and state["n"] == 1
