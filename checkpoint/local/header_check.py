"""The rules a local-tier shard header's tensor table must follow before any byte is viewed.

A shard comes from a file or a peer: input. Its checksum is not keyed, so a header that
passes it can still be crafted. ``entry_problem`` says what is wrong with one row of the table;
``packing.parse`` turns any answer into a ``CheckpointError`` naming the key, so a crafted row
never reaches ``as_strided`` (a negative offset would read the header as data, a huge one
raise a bare ``RuntimeError``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def entry_problem(row: Any, dtypes: Mapping[str, torch.dtype]) -> str | None:
    """What is wrong with one ``[key, dtype, shape, offset, nbytes]`` row, or None: a known
    dtype, a shape of ints >= 0, an offset >= 0 aligned to the element size, and ``nbytes``
    exactly the bytes of that shape."""
    if not (isinstance(row, list) and len(row) == 5 and isinstance(row[0], str)):
        return f"tensor row {row!r:.60} is not [key, dtype, shape, offset, nbytes]"
    key, dtype, shape, offset, nbytes = row
    if dtype not in dtypes:
        return f"tensor {key!r} has dtype {dtype!r:.30}, not one a shard holds"
    if not (isinstance(shape, list) and all(_int(d) and d >= 0 for d in shape)):
        return f"tensor {key!r} has shape {shape!r:.60}, not a list of sizes >= 0"
    size = dtypes[dtype].itemsize
    if not (_int(offset) and offset >= 0 and offset % size == 0):
        return f"tensor {key!r} has offset {offset!r:.30}, not a multiple of {size} >= 0"
    if not (_int(nbytes) and nbytes == math.prod(shape) * size):
        want = math.prod(shape) * size
        return f"tensor {key!r} has {nbytes!r:.30} bytes, not the {want} of its shape"
    return None
