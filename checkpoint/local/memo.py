"""The local tier's walk memo: the leaves of tensor mappings, reused while they are unchanged.

A per-step local save walks the whole state to find its tensors. Most of a training state sits
in mappings of tensors, or of mappings of tensors, that the caller hands over again, unchanged,
at every save: torch's ``get_state_dict`` cached as in examples/state.py, a model's state dict,
an optimizer's per-parameter state. For such a mapping the walk remembers its keys (in
insertion order) and its tensors, and at the next save takes the leaves from the memo when the
same mapping holds the same keys and the same tensor objects, compared in C (``tuple(mapping)``,
``map(operator.is_, ...)``), instead of walking it in Python. A DTensor's local shard and
sharding are reused only while the DTensor still holds the same local tensor and spec. Shape,
dtype or device changes of the same tensor object are still caught: the tier compares them with
its cached layout at every save (LocalTier._plan).

The memo holds no tensor, mapping or mesh: only weak references to tensors and specs, keys, and
sharding tuples. A memo that kept a DTensor alive would keep its mesh, and a restart's destroyed
process group, alive after ``train()`` unwound. Entries not met in a walk are dropped at its end.

Used by one thread at a time (the training thread's LocalTier.save).
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from checkpoint import _torch_private
from checkpoint.local.packing import Leaf, ReplicatedState, walk_order

_Key = tuple[int, str, bool]  # (id of the mapping, its path, under a ReplicatedState)
# A mapping with fewer plain tensors in it (one parameter's optimizer state: step, exp_avg,
# exp_avg_sq) is walked: checking its memo cost as much as walking it. A DTensor is always
# worth it: its to_local() and sharding cost microseconds each.
_MIN_PLAIN = 8
_UNSEEN: Any = object()


@dataclass(slots=True)
class _Tensor:
    """A tensor value as the last walk saw it: its leaf, and for a DTensor its parts."""

    ref: weakref.ref[torch.Tensor]
    path: str
    sharding: Any
    local: weakref.ref[torch.Tensor] | None = None  # a DTensor's local tensor (the leaf value)
    spec: weakref.ref[Any] | None = None  # a DTensor's spec


@dataclass(slots=True)
class _Node:
    """A mapping of tensors and such mappings, as the last walk saw it."""

    order: tuple[Any, ...]  # its keys, in insertion order
    values: tuple[_Tensor | _Node, ...]  # its values, same order
    walk: tuple[tuple[Any, int], ...]  # (key, position in `order`) in the walk's sorted order
    plain: bool  # every value a plain tensor: one C-level identity check
    paths: tuple[str, ...]  # each value's leaf path ("" for a mapping), same order

    def refs(self) -> list[torch.Tensor | None]:
        return [v.ref() if isinstance(v, _Tensor) else None for v in self.values]


def _replay(obj: Mapping[Any, Any], node: _Node, rep: bool, out: list[Leaf]) -> bool:
    """Append the leaves of `obj` if it is what `node` remembers; False (out unchanged beyond
    what the caller truncates) otherwise."""
    if len(obj) != len(node.order) or tuple(obj) != node.order:
        return False
    values = list(obj.values())
    if node.plain:
        if not all(map(operator.is_, values, node.refs())):
            return False
        paths = node.paths
        out.extend([Leaf(paths[i], values[i], obj, k, rep, None) for k, i in node.walk])
        return True
    for k, i in node.walk:
        v, seen = values[i], node.values[i]
        if isinstance(seen, _Node):
            if not isinstance(v, Mapping) or not _replay(v, seen, rep, out):
                return False
            continue
        if v is not seen.ref():
            return False
        if seen.local is not None and seen.spec is not None:  # a DTensor: its parts unchanged
            local, spec = _torch_private.dtensor_local_and_spec(v)
            if local is not seen.local() or spec is not seen.spec():
                return False
            v = local
        out.append(Leaf(seen.path, v, obj, k, rep, seen.sharding))
    return True


def _node(obj: Mapping[Any, Any], by_place: dict[tuple[int, Any], Leaf]) -> _Node | None:
    """The node of `obj` from the leaves its walk gave (by container and index), or None when
    something in it is not a tensor or a plain mapping of them."""
    order = tuple(obj)
    values: list[_Tensor | _Node] = []
    for k in order:
        v = obj[k]
        if isinstance(v, Mapping) and not isinstance(v, ReplicatedState):
            child = _node(v, by_place)
            if child is None:
                return None
            values.append(child)
            continue
        x = by_place.get((id(obj), k))
        if x is None or not isinstance(v, torch.Tensor) or not isinstance(x.value, torch.Tensor):
            return None
        t = _Tensor(weakref.ref(v), x.key, x.sharding)
        if x.sharding is not None:
            local, spec = _torch_private.dtensor_local_and_spec(v)
            if local is not x.value:  # to_local() gave a copy: nothing to reuse safely
                return None
            t.local, t.spec = weakref.ref(local), weakref.ref(spec)
        values.append(t)
    position = {k: i for i, k in enumerate(order)}
    walk = [(k, position[k]) for k in walk_order(obj)]
    plain = all(isinstance(v, _Tensor) and v.local is None for v in values)
    paths = tuple(v.path if isinstance(v, _Tensor) else "" for v in values)
    return _Node(order, tuple(values), tuple(walk), plain, paths)


class WalkMemo:
    """Tensor mappings of the last walk. Call order per walk: begin(), then replay() /
    remember() from the walk (packing.leaves), then end()."""

    def __init__(self) -> None:
        # None: met, but not a mapping worth remembering (not checked again while it is met).
        self._last: dict[_Key, _Node | None] = {}
        self._next: dict[_Key, _Node | None] = {}

    def begin(self) -> None:
        self._next = {}

    def end(self) -> None:
        """Keep only what this walk met (a mapping freed since cannot come back)."""
        self._last, self._next = self._next, {}

    def replay(
        self, obj: Mapping[Any, Any], prefix: str, rep: bool, out: list[Leaf]
    ) -> bool | None:
        """Append the leaves of `obj` from the memo and return True when it is unchanged; False:
        walk it and call remember(); None: walk it, there is nothing to remember."""
        key = (id(obj), prefix, rep)
        node = self._last.get(key, _UNSEEN)
        if node is None:
            self._next[key] = None
            return None
        if node is _UNSEEN:
            return False
        start = len(out)
        if not _replay(obj, node, rep, out):
            del out[start:]
            return False
        self._next[key] = node
        return True

    def remember(self, obj: Mapping[Any, Any], prefix: str, rep: bool, leaves: list[Leaf]) -> None:
        """After a full walk of `obj` gave `leaves`: keep it if it is a mapping of tensors (and
        of such mappings) with enough in it to be worth a memo."""
        key = (id(obj), prefix, rep)
        node = None
        worth = len(leaves) >= _MIN_PLAIN or any(x.sharding is not None for x in leaves)
        # Every leaf a tensor first (cheap): a mapping with scalars in it is not remembered.
        if worth and all(isinstance(x.value, torch.Tensor) for x in leaves):
            node = _node(obj, {(id(x.container), x.index): x for x in leaves})
        self._next[key] = node
