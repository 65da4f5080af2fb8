"""Flat buffers for the local tier: pack a state's tensors and scalars into one uint8 buffer.

One buffer per shard lets the local tier copy, checksum, write and send a shard as a single block
(one file, one message per peer) instead of one operation per tensor.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from restartable.checkpoint import _torch_private
from restartable.checkpoint.errors import CheckpointError
from restartable.checkpoint.local import header_check, sharded
from restartable.checkpoint.local.leaf import Leaf

MAGIC = b"RSTLOCAL"
_PREFIX = struct.Struct("<8sQ")  # magic, header length
PREFIX_SIZE = _PREFIX.size
ALIGN = 64  # every tensor starts on a 64-byte boundary so a uint8 slice can be viewed as any dtype
_MAX_VIEW_SETS = 8  # save buffers per layout whose views are cached (keep + 2, and some slack)
# What torch._foreach_copy_ takes: a list or a tuple (a save passes its tensors as they come).
Tensors = list[torch.Tensor] | tuple[torch.Tensor, ...]

_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.complex64,
        torch.complex128,
    )
}


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives in the data part of a packed buffer."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # from the start of the data part
    nbytes: int


@dataclass(frozen=True)
class ShardLayout:
    """The tensor placement of one state: reused while the state's structure stays the same."""

    entries: tuple[TensorEntry, ...]
    data_nbytes: int
    tensors_json: str  # the header's tensor table, encoded once
    # DTensor entries' sharding (sharded.to_json) by key, and its header form, encoded once.
    sharding: dict[str, dict[str, Any]] = field(default_factory=dict, compare=False)
    sharding_json: str = "{}"
    has_empty: bool = False  # an entry of 0 bytes (it has no view: pack_into filters)
    # Typed views of each entry in the save buffers this layout was packed into, by (address,
    # data start). A view keeps its buffer alive, so no other buffer can take its address.
    _views: dict[tuple[int, int], list[torch.Tensor]] = field(
        default_factory=dict, compare=False, repr=False
    )

    def views(self, buf: torch.Tensor, data_start: int) -> list[torch.Tensor]:
        """The non-empty entries as typed views of `buf`. A local save reuses its buffers, so
        these are built once per buffer instead of once per save (for the example's 116 tensors
        that was a third of the tier's own work per save: benchmarks/local_save.py)."""
        key = (buf.data_ptr(), data_start)
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= _MAX_VIEW_SETS:
                self._views.clear()
            views = self._views[key] = _views(buf, data_start, self.entries)
        return views

    @staticmethod
    def of(tensors: list[Leaf]) -> ShardLayout:
        entries = []
        shardings = {}
        off = 0
        for leaf in tensors:
            if leaf.sharding is not None:
                shardings[leaf.key] = sharded.to_json(leaf.sharding)
            t: torch.Tensor = leaf.value
            nbytes = t.numel() * t.element_size()
            dtype = str(t.dtype).removeprefix("torch.")
            if dtype not in _DTYPES:
                raise CheckpointError(
                    f"state entry {leaf.key!r} has dtype {t.dtype}, which the local tier does not "
                    f"support: use one of {sorted(_DTYPES)}"
                )
            entries.append(TensorEntry(leaf.key, dtype, tuple(t.shape), off, nbytes))
            off = _align(off + nbytes)
        table = [[e.key, e.dtype, list(e.shape), e.offset, e.nbytes] for e in entries]
        empty = any(e.nbytes == 0 for e in entries)
        return ShardLayout(
            tuple(entries), off, compact(table), shardings, compact(shardings), empty
        )


def header_bytes(
    layout: ShardLayout,
    objects: dict[str, Any],
    extra: dict[str, Any],
    *,
    objects_json: str | None = None,
) -> bytes:
    """The JSON header that makes a packed buffer self-describing (for files and peers).

    objects_json: ``compact(objects)`` when the caller already has it (a save parses it back as
    its snapshot of the scalars, so it is encoded once).
    """
    # Same document as json.dumps({"tensors": ..., "objects": ..., "extra": ...}); the tensor
    # table is encoded once per layout.
    if objects_json is None:
        objects_json = compact(objects)
    return (
        f'{{"tensors":{layout.tensors_json},"objects":{objects_json},'
        f'"extra":{compact(extra)},"sharding":{layout.sharding_json}}}'
    ).encode()


def compact(obj: Any) -> str:
    """JSON without spaces (the header's encoding)."""
    return json.dumps(obj, separators=(",", ":"))


def packed_size(layout: ShardLayout, header: bytes) -> int:
    return _align(_PREFIX.size + len(header)) + layout.data_nbytes


def pack_into(
    buf: torch.Tensor,
    layout: ShardLayout,
    header: bytes,
    tensors: Tensors,
    *,
    non_blocking: bool | None = None,
) -> int:
    """Copy header and tensors (the values of the leaves `layout` was made of, in its order)
    into `buf` (uint8, CPU, large enough); returns the bytes used.

    This is the whole stall of a local save: one copy per tensor into a reused buffer (see
    ``_copy``). GPU sources copy asynchronously into the (pinned) buffer; the caller
    synchronizes once. non_blocking: whether a tensor is on a GPU, when the caller knows it
    (None: looked up per tensor).
    """
    data_start = _align(_PREFIX.size + len(header))
    prefix = _PREFIX.pack(MAGIC, len(header)) + header
    buf[: len(prefix)].copy_(torch.frombuffer(bytearray(prefix), dtype=torch.uint8))
    srcs = tensors
    if layout.has_empty:
        srcs = [t for t, e in zip(tensors, layout.entries, strict=True) if e.nbytes]
    _copy(layout.views(buf, data_start), srcs, non_blocking=non_blocking)
    return data_start + layout.data_nbytes


def _views(
    buf: torch.Tensor, data_start: int, entries: Sequence[TensorEntry]
) -> list[torch.Tensor]:
    """Each non-empty entry's bytes at ``data_start`` of ``buf``, viewed as its dtype and shape."""
    views = []
    typed: dict[str, torch.Tensor] = {}  # the data region as each dtype (offsets are aligned)
    end = data_start + max((_align(e.offset + e.nbytes) for e in entries), default=0)
    if any(e.offset + e.nbytes > buf.numel() - data_start for e in entries):
        raise CheckpointError("not a local-tier shard (a tensor's bytes lie past its end)")
    for entry in entries:
        if entry.nbytes:
            region = typed.get(entry.dtype)
            if region is None:
                region = buf[data_start:end].view(_DTYPES[entry.dtype])
                typed[entry.dtype] = region
            views.append(_typed_view(region, entry))
    return views


def _copy(
    dsts: Tensors,
    srcs: Tensors,
    *,
    non_blocking: bool | None = None,
) -> None:
    """Copy every source into its destination as one ``torch._foreach_copy_``: a per-tensor
    Python loop cost more than the copies for a small model's ~100 tensors. The copies are
    dtype-aware, so strided, lazily conjugated and GPU tensors are handled; GPU copies are
    asynchronous (the caller synchronizes once)."""
    if not dsts:
        return
    if non_blocking is None:
        non_blocking = any(t.is_cuda for t in (*dsts, *srcs))
    with torch.no_grad():
        _torch_private.foreach_copy(dsts, srcs, non_blocking=non_blocking)


def copy_entries(
    buf: torch.Tensor,
    data_start: int,
    entries: Sequence[TensorEntry],
    tensors: Sequence[Leaf],
    *,
    into_buf: bool,
) -> None:
    """Copy every tensor to (``into_buf``) or from its entry's bytes at ``data_start`` (the
    entries and the leaves in the same order)."""
    views = _views(buf, data_start, entries)
    others = [leaf.value for leaf, e in zip(tensors, entries, strict=True) if e.nbytes]
    if into_buf:
        _copy(views, others)
    else:
        _copy(others, views)


def _typed_view(region: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
    """`entry` in `region`, the data part of a buffer viewed as the entry's dtype: one call."""
    n = region.element_size()
    start = region.storage_offset() + entry.offset // n  # as_strided counts from the storage
    return region.as_strided(entry.shape, _contiguous_strides(entry.shape), start)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(strides))


@dataclass(frozen=True)
class Parsed:
    """A packed buffer's header, decoded."""

    entries: dict[str, TensorEntry]
    objects: dict[str, Any]
    extra: dict[str, Any]
    data_start: int
    sharding: dict[str, dict[str, Any]] = field(default_factory=dict)  # DTensor entries' only


def parse(buf: torch.Tensor) -> Parsed:
    """Decode the header of a packed buffer; CheckpointError when it is not one."""
    hlen = _header_len(bytes(buf[: _PREFIX.size].numpy()))
    if _PREFIX.size + hlen > buf.numel():
        raise CheckpointError("not a local-tier shard (header longer than the buffer)")
    try:
        doc = json.loads(bytes(buf[_PREFIX.size : _PREFIX.size + hlen].numpy()))
        for row in doc["tensors"]:
            if (problem := header_check.entry_problem(row, _DTYPES)) is not None:
                raise ValueError(problem)
        entries = {k: TensorEntry(k, d, tuple(s), off, n) for k, d, s, off, n in doc["tensors"]}
        sharding = doc.get("sharding", {})
        if not isinstance(sharding, dict):
            raise TypeError(f"sharding is a {type(sharding).__name__}")
        return Parsed(entries, doc["objects"], doc["extra"], _align(_PREFIX.size + hlen), sharding)
    except (ValueError, KeyError, TypeError) as e:  # a corrupt copy (its checksum fails too)
        raise CheckpointError(f"not a local-tier shard (header does not decode: {e})") from e


def header_end(prefix: bytes) -> int:
    """Where the header ends and the data part starts, from the first PREFIX_SIZE bytes of a
    packed buffer."""
    return _align(_PREFIX.size + _header_len(prefix))


def _header_len(prefix: bytes) -> int:
    """The header length recorded in a packed buffer's prefix; CheckpointError if it has none."""
    if len(prefix) < _PREFIX.size:
        raise CheckpointError("not a local-tier shard (shorter than its prefix)")
    magic, hlen = _PREFIX.unpack(prefix[: _PREFIX.size])
    if magic != MAGIC:
        raise CheckpointError("not a local-tier shard (bad magic)")
    return int(hlen)


def copy_in(buf: torch.Tensor, layout: ShardLayout, tensors: list[Leaf]) -> None:
    """Copy tensors into a header-less buffer laid out by `layout` (fully_parallel broadcast)."""
    copy_entries(buf, 0, layout.entries, tensors, into_buf=True)


def copy_out(buf: torch.Tensor, layout: ShardLayout, tensors: list[Leaf]) -> None:
    """The inverse of copy_in: fill the tensors from the buffer."""
    copy_entries(buf, 0, layout.entries, tensors, into_buf=False)
