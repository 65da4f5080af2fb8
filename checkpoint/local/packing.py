"""Flat buffers for the local tier: pack a state's tensors and scalars into one uint8 buffer.

One buffer per shard lets the local tier copy, checksum, write and send a shard as a single block
(one file, one message per peer) instead of one operation per tensor.
"""

from __future__ import annotations

import base64
import copy
import io
import itertools
import json
import struct
from collections.abc import Callable, Mapping, MutableMapping, MutableSequence, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch

from checkpoint.errors import CheckpointError, CheckpointMismatchError
from checkpoint.local import header_check, sharded

if TYPE_CHECKING:
    from checkpoint.local.memo import Block, WalkMemo

MAGIC = b"RSTLOCAL"
_PREFIX = struct.Struct("<8sQ")  # magic, header length
PREFIX_SIZE = _PREFIX.size
ALIGN = 64  # every tensor starts on a 64-byte boundary so a uint8 slice can be viewed as any dtype
_MAX_VIEW_SETS = 8  # save buffers per layout whose views are cached (keep + 2, and some slack)
# What torch._foreach_copy_ takes: a list or a tuple (a save passes its tensors as they come).
Tensors = list[torch.Tensor] | tuple[torch.Tensor, ...]
PART_MAX = 32 << 20  # a shard moves in parts of at most this size (see part_bounds)
DIRECT_MIN = 1 << 20  # a tensor this large is a part (or parts) of its own

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


# Header form of a leaf that is neither a tensor nor JSON (bytes, RNG states, small objects):
# torch.save's bytes, base64-encoded, read back with torch.load(weights_only=True) (the restricted
# loader DCP and torch use: tensors, containers, primitives and the NumPy types RNG states hold;
# nothing named by the data is imported or called). A shard comes from a node-local directory or
# a peer, which others may be able to write: a header never runs code. An object that the
# restricted loader would refuse is refused at save time, with its key.
_SAVED = "__restartable_saved__"
# Header form of a ``bytes`` leaf (the re-run machine's RNG and data snapshots): base64 of the
# bytes themselves. bytes cannot hold code, so no torch.save / restricted load round trip is
# needed; that round trip cost ~0.5 ms per leaf on every save (two of the example's leaves, most
# of the tier's own work on the training thread: benchmarks/step_overhead.py).
_BYTES = "__restartable_bytes__"


def _encode_object(key: str, obj: Any) -> dict[str, str]:
    buf = io.BytesIO()
    try:
        torch.save(obj, buf)
        payload = buf.getvalue()
        safe_load(payload)
    except Exception as exc:
        raise CheckpointError(
            f"state entry {key!r} has type {type(obj).__name__}, which the local tier cannot "
            f"keep as plain data ({short_reason(exc)}): use tensors, dicts, lists, "
            "scalars, bytes, NumPy arrays or Stateful objects whose state_dict() holds those"
        ) from exc
    return {_SAVED: base64.b64encode(payload).decode("ascii")}


def _decode_object(src: Any) -> Any:
    """A header value back into the state's form: restricted-loaded, or a copy of the JSON."""
    if isinstance(src, dict) and len(src) == 1 and _BYTES in src:
        try:
            return base64.b64decode(src[_BYTES], validate=True)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(
                f"a local-tier shard holds bytes that do not decode ({exc}): refused; the copy "
                "is corrupt or was not written by this job"
            ) from exc
    if isinstance(src, dict) and set(src) == {_SAVED}:
        try:
            return safe_load(base64.b64decode(src[_SAVED]))
        except Exception as exc:
            raise CheckpointError(
                f"a local-tier shard holds an object that is not plain data ({short_reason(exc)})"
                ": refused unread; the file was not written by this job"
            ) from exc
    return copy.deepcopy(src)


def safe_load(payload: bytes) -> Any:
    """``torch.load(weights_only=True)`` of ``payload``, also allowing the NumPy types of an RNG
    state (``numpy.random.get_state()``)."""
    with torch.serialization.safe_globals(numpy_globals()):
        return torch.load(io.BytesIO(payload), weights_only=True)


def short_reason(exc: BaseException) -> str:
    """The line of torch's weights-only refusal that names the global, not its long advice."""
    text = str(exc)
    for line in text.splitlines():
        if "WeightsUnpickler error" in line:
            return line.strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def numpy_globals() -> list[Any]:
    """What the restricted loader accepts beyond torch's defaults: the plain built-in types an
    object's pickle names (bytes, sets) and the NumPy callables and types a NumPy array or
    scalar unpickles through (an RNG state)."""
    import numpy as np

    multiarray = getattr(np, "_core", np.core).multiarray  # numpy 2 / 1
    dtypes = {type(np.dtype(c)) for c in "?bhilqBHILQefdgFDG"}
    plain = [bytes, bytearray, set, frozenset]
    return [*plain, multiarray._reconstruct, multiarray.scalar, np.ndarray, np.dtype, *dtypes]


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


class ReplicatedState(dict[str, Any]):
    """Marks the part of a state that is identical on every rank (plain data parallelism).

    ``state = {"model": ReplicatedState(model.state_dict()), "rng": rng_state}``: with
    ``local_algo="fully_parallel"`` each rank keeps and replicates only its share of the tensors
    under a ReplicatedState, and a restore broadcasts the shares. It is a plain dict to every other
    reader (the persistent tier, DCP), so it changes nothing there.
    """


@dataclass(slots=True)
class Leaf:
    """One leaf of a state: a tensor, a JSON scalar or an encoded object, and where it sits."""

    key: str
    value: Any
    container: Any  # the dict / list that holds it
    index: Any  # its key / position in `container`
    replicated: bool = False  # under a ReplicatedState
    # A DTensor's sharding (checkpoint.local.sharded); `value` is then its local shard.
    sharding: sharded.Sharding | None = None


def is_stateful(obj: Any) -> bool:
    """DCP's Stateful protocol: an object with state_dict() and load_state_dict()."""
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


# JSON scalars. walk() tests the exact types, so subclasses (enums) take the long path.
_SCALARS = (bool, int, float, str)
_EXACT_SCALARS = frozenset((*_SCALARS, type(None)))


def _is_json_scalar_tree(obj: Any) -> bool:
    if obj is None or isinstance(obj, _SCALARS):
        return True
    # A list of exact scalars (an optimizer's parameter names) in one C-level pass.
    if type(obj) in (list, tuple) and _EXACT_SCALARS.issuperset(map(type, obj)):
        return True
    if isinstance(obj, (list, tuple)):
        return all(_is_json_scalar_tree(x) for x in obj)
    if isinstance(obj, Mapping):
        return all(isinstance(k, str) and _is_json_scalar_tree(v) for k, v in obj.items())
    return False


def leaves(state: Mapping[str, Any], statefuls: list[tuple[Any, dict[str, Any]]]) -> list[Leaf]:
    """Every leaf of `state`, keyed by its '/'-joined path, in a deterministic order.

    Stateful objects are expanded through their state_dict(); each (object, that dict) pair is
    appended to `statefuls` so a load can hand the filled dict back via load_state_dict().
    """
    out: list[Leaf | Block] = []
    _walk(state, "", None, None, False, out, statefuls, None)
    return cast("list[Leaf]", out)  # without a memo, every part is a Leaf


def save_parts(
    state: Mapping[str, Any], statefuls: list[tuple[Any, dict[str, Any]]], memo: WalkMemo
) -> list[Leaf | Block]:
    """The local tier's save walk: leaves() in the same order, except that each mapping of
    tensors unchanged since the last walk with `memo` is one memo.Block of its tensors
    (checkpoint.local.memo); memo.expand gives the leaves."""
    out: list[Leaf | Block] = []
    memo.begin()
    _walk(state, "", None, None, False, out, statefuls, memo)
    memo.end()
    return out


def walk_order(mapping: Mapping[Any, Any]) -> list[Any]:
    """The keys of `mapping` in the order the walk visits them (and the memo replays them)."""
    keys = list(mapping)
    if all(type(k) is str for k in keys):
        keys.sort()  # the same order as key=str, without a call per key
    else:
        keys.sort(key=str)
    return keys


# A module-level function, not a recursive closure: a closure that calls itself is a reference
# cycle, which held `out` and `statefuls` (the user's state: a DDP module and its process group)
# until the cyclic GC happened to run. After a restart the destroyed group then stayed
# referenced, and the peers blocked on this rank waited for the gloo timeout (12.5 s in 2 of 5
# restarts of the README-style script).
def _walk(
    obj: Any,
    prefix: str,
    container: Any,
    index: Any,
    rep: bool,
    out: list[Leaf | Block],
    statefuls: list[tuple[Any, dict[str, Any]]],
    memo: WalkMemo | None,
) -> None:
    # Runs at every local save (a small model's state has a few hundred nodes): the common
    # cases are tested first.
    cls = type(obj)
    if cls is torch.Tensor or cls is torch.nn.Parameter:  # most leaves: no DTensor test needed
        out.append(Leaf(prefix, obj, container, index, rep))
    elif isinstance(obj, torch.Tensor) and sharded.is_dtensor(obj):
        local, sharding = sharded.local_and_sharding(obj)
        out.append(Leaf(prefix, local, container, index, rep, sharding))
    elif isinstance(obj, torch.Tensor) or obj is None or cls in _SCALARS:
        out.append(Leaf(prefix, obj, container, index, rep))
    elif isinstance(obj, Mapping):
        rep = rep or isinstance(obj, ReplicatedState)
        fresh = memo.replay(obj, prefix, rep, out) if memo is not None else None
        if fresh:
            return
        start = len(out)
        for k in walk_order(obj):
            path = f"{prefix}/{k}" if prefix else str(k)
            _walk(obj[k], path, obj, k, rep, out, statefuls, memo)
        if fresh is False:
            assert memo is not None
            memo.remember(obj, prefix, rep, out[start:])
    elif is_stateful(obj):
        sd = obj.state_dict()
        statefuls.append((obj, sd))
        _walk(sd, prefix, None, None, rep, out, statefuls, memo)
    elif _is_json_scalar_tree(obj):  # a list of scalars (a param group's names) is one leaf
        out.append(Leaf(prefix, obj, container, index, rep))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _walk(v, f"{prefix}/{i}", obj, i, rep, out, statefuls, memo)
    elif type(obj) is bytes:
        encoded = {_BYTES: base64.b64encode(obj).decode("ascii")}
        out.append(Leaf(prefix, encoded, container, index, rep))
    else:
        out.append(Leaf(prefix, _encode_object(prefix, obj), container, index, rep))


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
        torch._foreach_copy_(dsts, srcs, non_blocking=non_blocking)


def _buffer_copy(
    buf: torch.Tensor,
    data_start: int,
    entries: Sequence[TensorEntry],
    tensors: Sequence[Leaf],
    *,
    into_buf: bool,
) -> None:
    """Copy every tensor to (``into_buf``) or from its entry's bytes at ``data_start``."""
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


# place(buf, bounds): called once part 0 (the header) of a shard is in buf[:bounds[1]]; returns
# {part index (>= 1): a uint8 tensor of exactly that part's size} for the parts that should land
# somewhere else than buf (a peer's or a file's copy restored straight into the state). Those
# parts are checksummed where they land.
Place = Callable[[torch.Tensor, list[int]], dict[int, torch.Tensor]]


def part_bounds(nbytes: int, parsed: Parsed | None) -> list[int]:
    """Boundaries 0 = b[0] < b[1] < ... < b[n] = nbytes of the parts a shard moves in (to a peer,
    from a file), so that a reader checksums one part while the next arrives and can take each
    large tensor straight into its place: the header alone first, then every tensor of at least
    DIRECT_MIN bytes in parts of its own, the bytes between them in parts of at most PART_MAX.
    Without the header (parsed None): parts of at most PART_MAX."""
    cuts = [0]
    if parsed is not None and parsed.data_start <= nbytes:
        cuts.append(parsed.data_start)
        for e in sorted(parsed.entries.values(), key=lambda e: e.offset):
            base = parsed.data_start + e.offset
            # Entries outside the shard or overlapping can only come from a corrupt header: they
            # travel with the bytes around them, and the reader's checksum rejects the copy.
            if e.nbytes >= DIRECT_MIN and base >= cuts[-1] and base + e.nbytes <= nbytes:
                cuts += [base, base + e.nbytes]
    cuts.append(nbytes)
    out = [0]
    for a, b in itertools.pairwise(cuts):
        out += range(a + PART_MAX, b, PART_MAX)
        if b > out[-1]:
            out.append(b)
    return out


def unpack_into(buf: torch.Tensor, state: Mapping[str, Any]) -> None:
    """Fill `state` in place from a packed buffer: tensors by copy_, scalars by assignment.

    A key, dtype or shape mismatch raises CheckpointError listing them all (nothing is filled).
    """
    statefuls: list[tuple[Any, dict[str, Any]]] = []
    fill_leaves(buf, leaves(state, statefuls))
    for obj, sd in statefuls:
        obj.load_state_dict(sd)


def match(
    parsed: Parsed, state_leaves: list[Leaf], keep: Callable[[str], bool] = lambda k: True
) -> list[tuple[Leaf, Any]]:
    """Pair every kept leaf with its source in the shard (a TensorEntry or a header value).

    Raises CheckpointMismatchError listing every key that is missing or differs in dtype or
    shape, or first sharded.ShardingMismatchError listing every DTensor whose saved mesh or
    placement differs from the live one (naming both); nothing has been written then.
    """
    bad: list[str] = []
    resharded: list[str] = []
    todo: list[tuple[Leaf, Any]] = []
    for leaf in state_leaves:
        if not keep(leaf.key):
            continue
        if isinstance(leaf.value, torch.Tensor):
            e = parsed.entries.get(leaf.key)
            t = leaf.value
            saved = parsed.sharding.get(leaf.key)
            live = sharded.to_json(leaf.sharding) if leaf.sharding is not None else None
            if e is not None and saved != live:
                resharded.append(
                    f"{leaf.key} (saved {sharded.describe(saved)}; live {sharded.describe(live)})"
                )
            elif e is None:
                bad.append(f"{leaf.key} (missing from the saved shard)")
            elif e.dtype != str(t.dtype).removeprefix("torch.") or e.shape != tuple(t.shape):
                bad.append(
                    f"{leaf.key} (saved {e.dtype}{list(e.shape)}, state {t.dtype}{list(t.shape)})"
                )
            else:
                todo.append((leaf, e))
        elif leaf.key not in parsed.objects:
            bad.append(f"{leaf.key} (missing from the saved shard)")
        else:
            todo.append((leaf, parsed.objects[leaf.key]))
    if resharded:
        raise sharded.ShardingMismatchError(
            "local checkpoint was saved with another sharding than the live DTensors (same "
            "mesh and placements needed; the persistent tier reshards): " + ", ".join(resharded),
            keys=[b.split(" (")[0] for b in resharded],
        )
    if bad:
        bad_keys = [b.split(" (")[0] for b in bad]
        raise CheckpointMismatchError(
            "local checkpoint does not match the state (same structure needed): " + ", ".join(bad),
            keys=bad_keys,
        )
    return todo


def fill_leaves(
    buf: torch.Tensor,
    state_leaves: list[Leaf],
    keep: Callable[[str], bool] = lambda k: True,
    parsed: Parsed | None = None,
) -> None:
    """unpack_into for the leaves for which keep(key) is true; Stateful objects not finished.

    `parsed`: the buffer's header when the caller already has it (a shard this process packed).
    """
    parsed = parsed if parsed is not None else parse(buf)
    todo = match(parsed, state_leaves, keep)
    tensor_todo = [(leaf, src) for leaf, src in todo if isinstance(src, TensorEntry)]
    _buffer_copy(
        buf,
        parsed.data_start,
        [e for _, e in tensor_todo],
        [leaf for leaf, _ in tensor_todo],
        into_buf=False,
    )
    for leaf, src in todo:
        if isinstance(src, TensorEntry):
            continue
        if isinstance(leaf.container, (MutableMapping, MutableSequence)):
            # A copy: the source may be a cached header that later restores read again.
            value = tuple(src) if isinstance(leaf.value, tuple) else _decode_object(src)
            leaf.container[leaf.index] = value
    if any(isinstance(x.value, torch.Tensor) and x.value.is_cuda for x, _ in todo):
        torch.cuda.synchronize()  # H2D copies were asynchronous; `buf` may be reused after this


def copy_in(buf: torch.Tensor, layout: ShardLayout, tensors: list[Leaf]) -> None:
    """Copy tensors into a header-less buffer laid out by `layout` (fully_parallel broadcast)."""
    _buffer_copy(buf, 0, layout.entries, tensors, into_buf=True)


def copy_out(buf: torch.Tensor, layout: ShardLayout, tensors: list[Leaf]) -> None:
    """The inverse of copy_in: fill the tensors from the buffer."""
    _buffer_copy(buf, 0, layout.entries, tensors, into_buf=False)
