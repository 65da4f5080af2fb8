"""The local tier's walk of a state: every leaf (tensor, JSON scalar or encoded object) and
where it sits, in a deterministic order; with a memo (``checkpoint.local.memo``), the mappings
unchanged since the last save as one block each."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

import torch

from restartable.checkpoint.local import header_objects, sharded
from restartable.checkpoint.local.leaf import Leaf, ReplicatedState

if TYPE_CHECKING:
    from restartable.checkpoint.local.memo import Block, WalkMemo


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
        out.append(Leaf(prefix, header_objects.encode_bytes(obj), container, index, rep))
    else:
        out.append(Leaf(prefix, header_objects.encode_object(prefix, obj), container, index, rep))
