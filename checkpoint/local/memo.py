"""The local tier's walk memo: the leaves of tensor mappings, reused while they are unchanged.

A per-step local save walks the whole state to find its tensors. Most of a training state sits
in mappings of tensors, or of mappings of tensors, that the caller hands over again, unchanged,
at every save: torch's ``get_state_dict`` cached as in examples/state.py, a model's state dict,
an optimizer's per-parameter state. For such a mapping the walk remembers, depth by depth,
the types and keys (in insertion order) of the mappings in it and its tensors, and at the next
save takes its tensors from the memo when the same mapping holds mappings of the same types with
the same keys and the same tensor objects: one Block (the record, and the tensors in leaf order)
stands for all of them in the walk's output, so a save builds no Leaf per tensor and compares
their keys as one object (LocalTier._plan). Each depth is compared as a whole in C
(``map(type, ...)``, ``map(tuple, ...)``, ``map(operator.is_, ...)``): the optimizer's 30
per-parameter mappings of the example cost one comparison, not 30 Python calls (that cost more
than walking them). A DTensor's local shard and sharding are reused only while the DTensor
still holds the same local tensor and spec. Shape, dtype or device changes of the same tensor
object are still caught: the tier compares them with its cached layout at every save
(LocalTier._plan).

The memo holds no tensor, mapping or mesh: only weak references to tensors and specs, keys,
types and sharding tuples. A memo that kept a DTensor alive would keep its mesh, and a restart's
destroyed process group, alive after ``train()`` unwound. Entries not met in a walk are dropped
at its end.

Used by one thread at a time (the training thread's LocalTier.save).
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain, repeat
from typing import Any, cast

import torch

from restartable.checkpoint import _torch_private
from restartable.checkpoint.local.leaf import Leaf, ReplicatedState

_Key = tuple[int, str, bool]  # (id of the mapping, its path, under a ReplicatedState)
# A mapping with fewer plain tensors in it (one parameter's optimizer state: step, exp_avg,
# exp_avg_sq) is walked: checking its memo cost as much as walking it. A DTensor is always
# worth it: its to_local() and sharding cost microseconds each.
_MIN_PLAIN = 8
_UNSEEN: Any = object()
_values = operator.methodcaller("values")


def picker(positions: list[int]) -> Callable[[Sequence[Any]], tuple[Any, ...]]:
    """``operator.itemgetter(*positions)`` that always returns a tuple (itemgetter of one
    position returns the item itself)."""
    if len(positions) == 1:
        (only,) = positions
        return lambda seq: (seq[only],)
    return operator.itemgetter(*positions)


@dataclass(slots=True)
class _Level:
    """The mappings at one depth of a remembered mapping, in breadth-first order."""

    types: tuple[type, ...]  # each mapping's exact type
    orders: tuple[tuple[Any, ...], ...]  # each mapping's keys, in insertion order
    # Positions in the concatenation of those mappings' values: the tensors (None: none)
    # and the mappings of the next level (None: this is the deepest level).
    tensors: Callable[[Sequence[Any]], tuple[Any, ...]] | None
    mappings: Callable[[Sequence[Any]], tuple[Any, ...]] | None


@dataclass(slots=True, eq=False)  # compared by identity: a save's plan keys on the record
class _Node:
    """A mapping of tensors and of such mappings (any depth), as the last walk saw it.

    Checked level by level with C-level calls over whole levels (types, key tuples, values),
    instead of one Python call per nested mapping: an optimizer's per-parameter states are one
    level of small mappings. Tensors are numbered in the order the levels list them ("flat").
    """

    levels: tuple[_Level, ...]
    refs: tuple[weakref.ref[torch.Tensor], ...]  # every tensor value, flat order
    # DTensors: (flat index, its local tensor, its spec) as the last walk saw them.
    dtensors: tuple[tuple[int, weakref.ref[torch.Tensor], weakref.ref[Any]], ...]
    # The leaves, in walk order: which flat tensor, its path, its sharding.
    values: Callable[[Sequence[Any]], tuple[Any, ...]]
    paths: tuple[str, ...]
    shardings: tuple[Any, ...]


@dataclass(slots=True)
class Block:
    """In a save's walk (walk.save_parts): the tensor leaves of a mapping the memo replayed.

    ``node`` is the same object at every save while the mapping keeps its structure (the same
    keys, paths, shardings and tensor objects), so a save compares its keys by identity;
    ``values`` are its tensors (a DTensor's local shard) in walk order. The walk's output keeps
    a Block only during the save: it references the live tensors.
    """

    node: _Node
    values: tuple[torch.Tensor, ...]
    replicated: bool

    def leaves(self) -> list[Leaf]:
        """The Leaf of each tensor (no container: a save never writes back)."""
        n = len(self.values)
        return list(
            map(
                Leaf,
                self.node.paths,
                self.values,
                repeat(None, n),
                repeat(None, n),
                repeat(self.replicated, n),
                self.node.shardings,
            )
        )


def expand(parts: Sequence[Leaf | Block]) -> list[Leaf]:
    """A save's walk as one Leaf per leaf, in walk order (what walk.leaves would give, less
    the containers of the Blocks' tensors)."""
    out: list[Leaf] = []
    for p in parts:
        if isinstance(p, Block):
            out += p.leaves()
        else:
            out.append(p)
    return out


def _replay(obj: Mapping[Any, Any], node: _Node) -> tuple[torch.Tensor, ...] | None:
    """The tensors of `obj` in leaf order if it is what `node` remembers, else None."""
    mappings: Sequence[Any] = (obj,)
    flat: list[Any] = []
    for level in node.levels:
        if tuple(map(type, mappings)) != level.types:
            return None
        if tuple(map(tuple, mappings)) != level.orders:
            return None
        values = list(chain.from_iterable(map(_values, mappings)))
        if level.tensors is not None:
            flat += level.tensors(values)
        if level.mappings is not None:
            mappings = level.mappings(values)
    if not all(map(operator.is_, flat, [r() for r in node.refs])):
        return None
    for i, local_ref, spec_ref in node.dtensors:  # a DTensor: its parts unchanged
        local, spec = _torch_private.dtensor_local_and_spec(flat[i])
        if local is not local_ref() or spec is not spec_ref():
            return None
        flat[i] = local
    return node.values(flat)


def _node(obj: Mapping[Any, Any], leaves: list[Leaf]) -> _Node | None:
    """The node of `obj` from the leaves its walk gave (every one a tensor), or None when
    something in it is neither a tensor leaf nor a plain mapping of them."""
    by_place = {(id(x.container), x.index): x for x in leaves}
    levels: list[_Level] = []
    flat: dict[tuple[int, Any], int] = {}  # (id of its holder, key) -> flat index
    refs: list[weakref.ref[torch.Tensor]] = []
    dtensors = []
    mappings: list[Mapping[Any, Any]] = [obj]
    while mappings:
        tensors, deeper, following = [], [], []
        position = 0
        for m in mappings:
            for k, v in m.items():
                if isinstance(v, Mapping):
                    if isinstance(v, ReplicatedState):  # its own rules: walked every time
                        return None
                    deeper.append(position)
                    following.append(v)
                else:
                    x = by_place.get((id(m), k))
                    if x is None or not isinstance(v, torch.Tensor):
                        return None
                    if x.sharding is not None:
                        local, spec = _torch_private.dtensor_local_and_spec(v)
                        if local is not x.value:  # to_local() gave a copy: nothing to reuse
                            return None
                        dtensors.append((len(refs), weakref.ref(local), weakref.ref(spec)))
                    tensors.append(position)
                    flat[(id(m), k)] = len(refs)
                    refs.append(weakref.ref(v))
                position += 1
        levels.append(_level(mappings, tensors, deeper))
        mappings = following
    if len(refs) != len(leaves) or not leaves:
        return None
    return _Node(
        tuple(levels),
        tuple(refs),
        tuple(dtensors),
        picker([flat[(id(x.container), x.index)] for x in leaves]),
        tuple(x.key for x in leaves),
        tuple(x.sharding for x in leaves),
    )


def _level(mappings: list[Mapping[Any, Any]], tensors: list[int], deeper: list[int]) -> _Level:
    """One depth of a node: its mappings' types and keys, and the positions (among all their
    values, in order) of the tensors and of the mappings one level deeper."""
    return _Level(
        tuple(map(type, mappings)),
        tuple(map(tuple, mappings)),
        picker(tensors) if tensors else None,
        picker(deeper) if deeper else None,
    )


class WalkMemo:
    """Tensor mappings of the last walk. Call order per walk: begin(), then replay() /
    remember() from the walk (walk.leaves), then end()."""

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
        self, obj: Mapping[Any, Any], prefix: str, rep: bool, out: list[Leaf | Block]
    ) -> bool | None:
        """Append the Block of `obj` and return True when it is unchanged; False: walk it and
        call remember(); None: walk it, there is nothing to remember."""
        key = (id(obj), prefix, rep)
        node = self._last.get(key, _UNSEEN)
        if node is None:
            self._next[key] = None
            return None
        values = None if node is _UNSEEN else _replay(obj, node)
        if values is None:
            return False
        self._next[key] = node
        out.append(Block(node, values, rep))
        return True

    def remember(
        self, obj: Mapping[Any, Any], prefix: str, rep: bool, parts: list[Leaf | Block]
    ) -> None:
        """After a full walk of `obj` gave `parts`: keep it if it is a mapping of tensors (and
        of such mappings) with enough in it to be worth a memo. One with a Block in its parts (it
        changed, a mapping in it did not) is not remembered: it is walked, and that mapping
        replayed, at the next saves too."""
        if any(isinstance(x, Block) for x in parts):
            return
        leaves = cast("list[Leaf]", parts)
        key = (id(obj), prefix, rep)
        node = None
        worth = len(leaves) >= _MIN_PLAIN or any(x.sharding is not None for x in leaves)
        # Every leaf a tensor first (cheap): a mapping with scalars in it is not remembered.
        if worth and all(isinstance(x.value, torch.Tensor) for x in leaves):
            node = _node(obj, leaves)
        self._next[key] = node


_LEAF_FIELDS = operator.attrgetter("key", "replicated", "sharding")


def split_parts(
    parts: list[Leaf | Block],
) -> tuple[list[torch.Tensor], tuple[Any, ...], dict[str, Any]]:
    """A save's walk as (its tensors in walk order, what identifies their keys, the other
    leaves by key: the header's objects). One pass over the parts: a remembered mapping's
    tensors come in one piece, identified by its memo record."""
    tensors: list[torch.Tensor] = []
    structure: list[Any] = []
    objects: dict[str, Any] = {}
    for p in parts:
        if isinstance(p, Block):
            tensors += p.values
            structure.append(p.node)
        elif isinstance(p.value, torch.Tensor):
            tensors.append(p.value)
            structure.append(_LEAF_FIELDS(p))
        else:
            objects[p.key] = p.value
    return tensors, tuple(structure), objects
