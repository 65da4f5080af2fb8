"""Fill a live state in place from a packed shard (``checkpoint.local.packing``): match every
leaf against the shard's header, then copy the tensors and set the other values."""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping, MutableSequence
from typing import Any

import torch

from restartable.checkpoint.errors import CheckpointMismatchError
from restartable.checkpoint.local import sharded
from restartable.checkpoint.local.header_objects import decode_object
from restartable.checkpoint.local.leaf import Leaf
from restartable.checkpoint.local.packing import Parsed, TensorEntry, copy_entries, parse
from restartable.checkpoint.local.walk import leaves


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
    copy_entries(
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
            value = tuple(src) if isinstance(leaf.value, tuple) else decode_object(src)
            leaf.container[leaf.index] = value
    if any(isinstance(x.value, torch.Tensor) and x.value.is_cuda for x, _ in todo):
        torch.cuda.synchronize()  # H2D copies were asynchronous; `buf` may be reused after this
